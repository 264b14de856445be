"""OpenAI response bodies and server-sent-event frames.

Streams follow the OpenAI chunk format exactly: `data: {json}\\n\\n` frames, for chat
the assistant role in the first chunk's delta together with the first text (as vLLM
sends it: no empty opening chunk, so a client timing the first byte of the body
measures the real time to first token), the finish reason on the last content chunk,
then (with `stream_options.include_usage`) a chunk with empty `choices` and the usage,
then `data: [DONE]`. With include_usage every earlier chunk has `"usage": null`, as
OpenAI sends it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.core import Chunk

DONE_FRAME = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Formatter:
    """Builds one request's response objects; `kind` is "completion" or "chat"."""

    def __init__(self, kind: str, response_id: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self._role_sent = False

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    # -- streaming ---------------------------------------------------------------------

    def chunk(self, c: Chunk) -> dict[str, Any] | None:
        """The frame for one token chunk; None when it carries nothing to send."""
        if not c.text and c.finish_reason is None:
            return None  # tokens whose text is still pending (partial UTF-8, held stop)
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": c.text} if c.text else {}
            if not self._role_sent:  # the first frame of the stream
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    # -- non-streaming -----------------------------------------------------------------

    def full(
        self, text: str, finish_reason: str | None, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens),
        }
