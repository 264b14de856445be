"""A request's output as the engine thread produces it and one reader consumes it."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator

from adaserve.request import TokenDelta
from adaserve.slo import SLOVerdict


class RequestStream:
    """Deltas of one request, produced by the engine thread, consumed by one reader
    (blocking `get` or `async for ... in stream.aiter()`). `verdict` is admission's
    judgement of the request's SLO, known from submit on."""

    def __init__(self, request_id: str, verdict: SLOVerdict) -> None:
        self.request_id = request_id
        self.verdict = verdict
        self._q: queue.SimpleQueue[TokenDelta] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None

    def put(self, delta: TokenDelta) -> None:
        self._q.put(delta)
        if self._loop is not None and self._wakeup is not None:
            # A closed loop: the reader is gone (its server stopped); the delta just waits.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wakeup.set)

    def get(self, timeout: float | None = None) -> TokenDelta | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    async def aiter(self) -> AsyncIterator[TokenDelta]:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        while True:
            self._wakeup.clear()
            while True:  # drain before waiting: deltas may predate the event
                try:
                    delta = self._q.get_nowait()
                except queue.Empty:
                    break
                yield delta
                if delta.finish_reason is not None:
                    return
            await self._wakeup.wait()
