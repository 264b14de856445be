"""OpenAI response bodies and server-sent-event frames.

Streams follow the OpenAI chunk format exactly: `data: {json}\\n\\n` frames, for chat
the assistant role in each choice's first chunk's delta together with its first text
(as vLLM sends it: no empty opening chunk, so a client timing the first byte of the body
measures the real time to first token), each choice's finish reason on its last content
chunk, then (with `stream_options.include_usage`) a chunk with empty `choices` and the
usage, then `data: [DONE]`. With include_usage every earlier chunk has `"usage": null`,
as OpenAI sends it.

Log-probabilities come in OpenAI's two shapes: chat's `logprobs.content` entries
(token, logprob, bytes, top_logprobs) and completions' parallel lists (tokens,
token_logprobs, top_logprobs as {token: logprob}, text_offset). Tokens whose text is
still held back (a partial character, a possible stop string) keep their entries until
the next frame of their choice, so every token's entry is sent exactly once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.core import Chunk, PromptScores
from gateway.tools import ToolPlan, ToolStream, parse

DONE_FRAME = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class _Choice:
    """One choice as it accumulates (non-streaming) or streams."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    role_sent: bool = False
    offset: int = 0  # completions' text_offset of the next token
    pending: list[dict[str, Any]] = field(default_factory=list)  # chat logprob entries
    pending_completion: dict[str, list[Any]] = field(default_factory=dict)
    logprob_sum: float = 0.0  # cumulative logprob of the sequence (best_of ranks by it)
    tools: ToolStream | None = None  # streamed chat with tools: content vs tool calls
    prompt_logprobs: list[Any] | None = None  # vLLM's prompt_logprobs field, when asked


class Formatter:
    """Builds one request's response objects; `kind` is "completion" or "chat"."""

    def __init__(
        self,
        kind: str,
        response_id: str,
        model: str,
        include_usage: bool,
        *,
        logprobs: bool = False,
        tokens_as_ids: bool = False,
        tools: ToolPlan | None = None,
        tool_format: str = "hermes",
    ) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs  # the client asked for them (best_of asks regardless)
        self.tokens_as_ids = tokens_as_ids
        self.tools = tools
        self.tool_format = tool_format
        self.choices: dict[int, _Choice] = {}
        self.prompt_logprobs: list[Any] | None = None  # chat: vLLM's response-level field

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

    def _choice(self, index: int) -> _Choice:
        ch = self.choices.get(index)
        if ch is None:
            ch = self.choices[index] = _Choice()
            if self.tools is not None and self.kind == "chat":
                ch.tools = ToolStream(self.tools, self.tool_format)
        return ch

    # -- logprobs ----------------------------------------------------------------------

    def _token(self, token_id: int, pieces: dict[int, str]) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return pieces.get(token_id, "")

    def _take_logprobs(self, ch: _Choice, c: Chunk) -> None:
        """Adds the chunk's entries to its choice's pending ones."""
        if c.logprobs is None or not c.token_ids:
            return
        lp, pieces = c.logprobs, c.pieces or {}
        ch.logprob_sum += float(lp.logprobs.sum())
        for i, tok in enumerate(c.token_ids):
            token = self._token(tok, pieces)
            top = [
                (self._token(int(t), pieces), float(v))
                for t, v in zip(lp.top_ids[i], lp.top_logprobs[i], strict=True)
            ]
            if self.kind == "chat":
                ch.pending.append(
                    {
                        "token": token,
                        "logprob": float(lp.logprobs[i]),
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top
                        ],
                    }
                )
            else:
                pc = ch.pending_completion
                pc.setdefault("tokens", []).append(token)
                pc.setdefault("token_logprobs", []).append(float(lp.logprobs[i]))
                pc.setdefault("top_logprobs", []).append(dict(top))
                pc.setdefault("text_offset", []).append(ch.offset)
                ch.offset += len(token)

    def _take_prompt(self, ch: _Choice, prompt: PromptScores, k: int) -> None:
        """The echoed prompt's entries (completions): the first token's logprob and
        top_logprobs are null, as OpenAI and vLLM send them; text_offset counts from
        where the choice's text starts."""
        pc = ch.pending_completion
        lp, pieces = prompt.logprobs, prompt.pieces
        for i, tok in enumerate(prompt.ids):
            token = self._token(tok, pieces)
            pc.setdefault("tokens", []).append(token)
            pc.setdefault("text_offset", []).append(ch.offset)
            ch.offset += len(token)
            if i == 0:
                pc.setdefault("token_logprobs", []).append(None)
                pc.setdefault("top_logprobs", []).append(None)
                continue
            top = zip(lp.top_ids[i - 1][:k], lp.top_logprobs[i - 1][:k], strict=True)
            pc.setdefault("token_logprobs", []).append(_finite(lp.logprobs[i - 1]))
            pc.setdefault("top_logprobs", []).append(
                {self._token(int(t), pieces): _finite(v) for t, v in top}
            )

    def _flush_logprobs(self, ch: _Choice) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            out: dict[str, Any] = {"content": ch.pending, "refusal": None}
            ch.pending = []
            return out
        pc, ch.pending_completion = ch.pending_completion, {}
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: pc.get(k, []) for k in keys}

    # -- streaming ---------------------------------------------------------------------

    def chunk(self, c: Chunk, index: int | None = None) -> dict[str, Any] | None:
        """The frame for one token chunk (of choice `index`, default the chunk's own);
        None when it carries nothing to send yet."""
        index = c.index if index is None else index
        ch = self._choice(index)
        self._take_logprobs(ch, c)
        text, calls = c.text, []
        if ch.tools is not None:  # chat with tools: what may be a tool call waits
            text = ch.tools.feed(c.text)
            if c.finish_reason is not None:
                rest, calls = ch.tools.finish()
                text += rest
        if not text and c.finish_reason is None:
            return None  # text still pending (partial UTF-8, held stop, maybe a tool call)
        ch.completion_tokens = c.num_generated
        logprobs = self._flush_logprobs(ch)
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:  # the whole call at once: a valid stream, as the client accumulates
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
            if not ch.role_sent:  # the first frame of this choice
                delta = {"role": "assistant", **delta}
                ch.role_sent = True
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                # A cut output keeps "length": the client learns that calls may be missing.
                "finish_reason": "tool_calls"
                if calls and c.finish_reason != "length"
                else c.finish_reason,
            }
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def text_frame(
        self, index: int, text: str, prompt: PromptScores | None = None, k: int = 0
    ) -> dict[str, Any]:
        """A completions frame of text alone (echo: the prompt before the output, with
        its tokens' logprobs when `prompt` is given, each with its top k)."""
        ch = self._choice(index)
        start = ch.offset
        if prompt is not None and self.logprobs:
            self._take_prompt(ch, prompt, k)
        ch.offset = start + len(text)
        logprobs = self._flush_logprobs(ch) if self.logprobs else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    # -- non-streaming -----------------------------------------------------------------

    def add(self, c: Chunk, index: int | None = None) -> None:
        """Accumulate a chunk into its choice, for `full`."""
        ch = self._choice(c.index if index is None else index)
        self._take_logprobs(ch, c)
        ch.text.append(c.text)
        ch.completion_tokens = c.num_generated
        if c.finish_reason is not None:
            ch.finish_reason = c.finish_reason

    def prefix(self, index: int, text: str, prompt: PromptScores | None = None, k: int = 0) -> None:
        """Text before a choice's output (echo), called before any of its chunks; with
        `prompt`, its tokens' logprobs (each with its top k) come first too."""
        ch = self._choice(index)
        ch.text.insert(0, text)
        start = ch.offset
        if prompt is not None and self.logprobs:
            self._take_prompt(ch, prompt, k)
        ch.offset = start + len(text)

    def set_prompt_logprobs(self, index: int | None, prompt: PromptScores, k: int) -> None:
        """vLLM's prompt_logprobs field: of choice `index` (completions), or of the
        response (chat: index None)."""
        value = vllm_prompt_logprobs(prompt, k, self.tokens_as_ids)
        if index is None:
            self.prompt_logprobs = value
        else:
            self._choice(index).prompt_logprobs = value

    def body(self, index: int) -> dict[str, Any]:
        """One choice of the full response."""
        ch = self.choices[index]
        logprobs = self._flush_logprobs(ch)
        text = "".join(ch.text)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = ch.finish_reason
            if self.tools is not None:
                content, calls = parse(text, self.tools, self.tool_format)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "length" if reason == "length" else "tool_calls"
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        out = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": ch.finish_reason,
        }
        if ch.prompt_logprobs is not None:
            out["prompt_logprobs"] = ch.prompt_logprobs
        return out

    def full(
        self, prompt_tokens: int, choices: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The whole response: every choice in index order (or `choices` as given)."""
        if choices is None:
            choices = [self.body(i) for i in sorted(self.choices)]
        completion = sum(ch.completion_tokens for ch in self.choices.values())
        out = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion),
        }
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


_MIN_LOGPROB = -9999.0  # what -inf is sent as (JSON has no infinity), as vLLM does


def _finite(v: Any) -> float:
    return max(float(v), _MIN_LOGPROB)


def vllm_prompt_logprobs(
    prompt: PromptScores, k: int, tokens_as_ids: bool = False
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token a dict
    from token id (a JSON string) to {logprob, rank, decoded_token}: the prompt's own
    token first, then the top k (rank 1 the most likely)."""
    lp, pieces = prompt.logprobs, prompt.pieces
    assert lp.ranks is not None

    def entry(tok: int, v: Any, rank: int) -> dict[str, Any]:
        text = f"token_id:{tok}" if tokens_as_ids else pieces.get(tok, "")
        return {"logprob": _finite(v), "rank": rank, "decoded_token": text}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for i, tok in enumerate(prompt.ids[1:]):
        pos = {str(tok): entry(tok, lp.logprobs[i], int(lp.ranks[i]))}
        for r, (t, v) in enumerate(zip(lp.top_ids[i][:k], lp.top_logprobs[i][:k], strict=True)):
            pos.setdefault(str(int(t)), entry(int(t), v, r + 1))
        out.append(pos)
    return out
