"""A generation request's response: the units' generations opened (one per prompt),
their chunks merged into response choices, and sent as server-sent events or collected
into one JSON body; the generations are closed when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import spec as specs
from gateway.core import Chunk, Gateway, Generation
from gateway.errors import APIError
from gateway.responses import DONE_FRAME, Formatter, sse


@dataclass(frozen=True)
class Shape:
    """What the client asked the response to look like."""

    stream: bool
    include_usage: bool
    n: int  # choices per prompt returned (best_of may generate more and keep the best)
    logprobs: bool  # the client asked for logprobs


async def serve(
    request: Request, gw: Gateway, built: list[specs.GenerateSpec], shape: Shape
) -> Response:
    """One generation per prompt (completions take a list), each of spec.n sequences;
    choice i of prompt p is response choice p * n + i."""
    opened = await asyncio.gather(*(gw.open(spec) for spec in built), return_exceptions=True)
    gens = [g for g in opened if isinstance(g, Generation)]
    failed = [e for e in opened if isinstance(e, BaseException)]
    if failed:
        await asyncio.gather(*(g.aclose() for g in gens))
        raise failed[0]
    first = gens[0]
    assert first.header is not None
    spec = built[0]
    fmt = Formatter(
        spec.kind,
        spec.response_id,
        first.header.model,
        shape.include_usage,
        logprobs=shape.logprobs,
        tokens_as_ids=spec.tokens_as_ids,
        tools=spec.tools,
        tool_format=first.header.tool_call_format,
    )
    best_effort = any(g.header is not None and g.header.best_effort for g in gens)
    headers = {
        "x-request-id": spec.client_request_id or spec.engine_id,
        # Judged at admission, so known before the first token (and the status line).
        "x-slo-best-effort": "true" if best_effort else "false",
    }
    if shape.stream:
        headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return _SSEResponse(gens, _events(gens, fmt), headers=headers)
    try:
        body = await _until_disconnect(request, _collect(gens, fmt, shape.n))
    finally:
        await asyncio.gather(*(g.aclose() for g in gens))
    if body is None:
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(body, headers=headers)


def _echo(gen: Generation) -> str | None:
    """The text to put before each of the generation's outputs (completions' echo)."""
    if not gen.spec.echo:
        return None
    if gen.spec.prompt_text is not None:
        return gen.spec.prompt_text
    return gen.header.prompt_text if gen.header else ""


def _echo_now(gen: Generation) -> str | None:
    """The echo sent before any chunk: all of it, unless the prompt's logprobs go with
    it (they come with the first chunk; the echo waits for them)."""
    return None if gen.spec.prompt_logprobs is not None else _echo(gen)


class _Choices:
    """Which generation each response choice belongs to, and what each choice still
    needs before its first chunk: the echo with the prompt's logprobs, vLLM's
    prompt_logprobs field; max_tokens 0 (echo only) hides the token generated."""

    def __init__(self, gens: list[Generation], fmt: Formatter) -> None:
        self.fmt = fmt
        self.owner = {p * g.spec.n + i: g for p, g in enumerate(gens) for i in range(g.spec.n)}
        self.started: set[int] = set()

    def chunk(self, index: int, c: Chunk) -> Chunk:
        gen = self.owner[index]
        if gen.spec.echo_only:
            c = replace(
                c,
                token_ids=(),
                text="",
                logprobs=None,
                num_generated=0,
                finish_reason=None if c.finish_reason is None else "length",
            )
        return c

    def first(self, index: int) -> tuple[Generation, str | None] | None:
        """The choice's generation and its deferred echo text, the first time only."""
        if index in self.started:
            return None
        self.started.add(index)
        gen = self.owner[index]
        fmt = self.fmt
        if gen.prompt is not None and gen.spec.prompt_logprobs_field is not None:
            fmt.set_prompt_logprobs(
                None if fmt.kind == "chat" else index, gen.prompt, gen.spec.prompt_logprobs_field
            )
        text = _echo(gen) if gen.spec.prompt_logprobs is not None else None
        return gen, text


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Chunk]]:
    """(response choice index, chunk) from every generation as they come."""
    if len(gens) == 1:
        async for c in gens[0].chunks():
            yield c.index, c
        return
    queue: asyncio.Queue[tuple[int, Chunk] | Exception | None] = asyncio.Queue()

    async def pump(p: int, gen: Generation) -> None:
        try:
            async for c in gen.chunks():
                queue.put_nowait((p * gen.spec.n + c.index, c))
            queue.put_nowait(None)
        except Exception as exc:  # handed to the reader, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(p, g)) for p, g in enumerate(gens)]
    left = len(gens)
    try:
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _slo(gens: list[Generation]) -> dict[str, object]:
    summary = gens[0].slo_summary()
    summary["best_effort"] = any(g.best_effort for g in gens)
    return summary


async def _events(gens: list[Generation], fmt: Formatter) -> AsyncIterator[str]:
    prompt_tokens = sum(g.header.num_prompt_tokens for g in gens if g.header)
    done: dict[int, int] = {}  # choice -> its tokens, once finished
    total = sum(g.spec.n for g in gens)
    for p, gen in enumerate(gens):
        if (text := _echo_now(gen)) is not None:
            for i in range(gen.spec.n):
                yield sse(fmt.text_frame(p * gen.spec.n + i, text))
    book = _Choices(gens, fmt)
    try:
        async for index, raw in _merged(gens):
            chunk = book.chunk(index, raw)
            if (started := book.first(index)) is not None:
                gen, text = started
                if text is not None:  # the echo with the prompt's logprobs
                    k = gen.spec.logprobs or 0
                    yield sse(fmt.text_frame(index, text, gen.prompt, k))
            frame = fmt.chunk(chunk, index)
            if chunk.finish_reason is not None:
                done[index] = chunk.num_generated
            if frame is not None:
                if len(done) == total and chunk.finish_reason is not None:
                    frame["slo"] = _slo(gens)
                yield sse(frame)
    except APIError as err:
        # Headers are gone already: the error travels as a frame (the openai client
        # raises APIError on it) and there is no [DONE], so nothing looks complete.
        yield sse(err.body())
        return
    if fmt.include_usage:
        yield sse(fmt.usage_chunk(prompt_tokens, sum(done.values())))
    yield DONE_FRAME


async def _collect(gens: list[Generation], fmt: Formatter, n: int) -> dict[str, Any]:
    for p, gen in enumerate(gens):
        if (text := _echo_now(gen)) is not None:
            for i in range(gen.spec.n):
                fmt.prefix(p * gen.spec.n + i, text)
    book = _Choices(gens, fmt)
    async for index, raw in _merged(gens):
        chunk = book.chunk(index, raw)
        if (started := book.first(index)) is not None:
            gen, text = started
            if text is not None:  # the echo with the prompt's logprobs
                fmt.prefix(index, text, gen.prompt, gen.spec.logprobs or 0)
        fmt.add(chunk, index)
    prompt_tokens = sum(g.header.num_prompt_tokens for g in gens if g.header)
    choices = None
    if any(g.spec.n > n for g in gens):  # best_of: each prompt's n most likely sequences
        choices = []
        for p, gen in enumerate(gens):
            ids = [p * gen.spec.n + i for i in range(gen.spec.n)]
            ids.sort(key=lambda i: -fmt.choices[i].logprob_sum)
            for j, i in enumerate(ids[:n]):
                choices.append(fmt.body(i) | {"index": p * n + j})
    body = fmt.full(prompt_tokens, choices)
    body["slo"] = _slo(gens)
    return body


async def _until_disconnect(request: Request, coro: Any) -> Any:
    """Runs `coro` unless the client disconnects first (then cancels it, returns None).
    The body is already read, so the next ASGI message can only be the disconnect."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        return work.result() if work in done else None
    finally:
        for task in (work, watch):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


class _SSEResponse(StreamingResponse):
    """Streams until done or until the client disconnects, whichever comes first, and
    always closes the generations: a vanished client cancels the verifier calls at once
    rather than at the next write."""

    def __init__(self, gens: list[Generation], content: AsyncIterator[str], headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._gens = gens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the socket closed under us
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await asyncio.gather(*(g.aclose() for g in self._gens))
