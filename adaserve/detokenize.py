"""Incremental detokenization with stop strings.

Decoding a whole sequence again per chunk is quadratic, and decoding tokens one at a
time breaks multi-byte characters and leading-space merges. So, as in TGI and vLLM,
decode a short window (`prefix_offset:`) and emit only the text past the part that
was already emitted, holding back text that ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the engine and the CLI use of a transformers tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything released to the client so far
    _buffer: str = ""  # decoded text, possibly with a held-back tail
    _released: int = 0
    _prefix_offset: int = 0
    _read_offset: int = 0

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Append tokens; return (text to release now, hit a stop string). On a stop
        string the text is cut before it (OpenAI and vLLM exclude the stop string)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return "", False  # wait for the rest of a multi-byte character
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return self._append(new)

    def _append(self, new: str) -> tuple[str, bool]:
        self._buffer += new
        if not self.stop:
            return self._release(len(self._buffer)), False
        # Only text that can no longer begin a stop string is released: hold back the
        # last (longest stop - 1) characters, so a stop string split across chunks is
        # never partly streamed.
        search_from = max(0, self._released - (self._max_stop - 1))
        hits = [i for i in (self._buffer.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self._buffer = self._buffer[: min(hits)]
            return self._release(len(self._buffer)), True
        return self._release(max(self._released, len(self._buffer) - (self._max_stop - 1))), False

    def flush(self) -> str:
        """The held-back tail, when the request ends without a stop string."""
        return self._release(len(self._buffer))

    def _release(self, upto: int) -> str:
        out = self._buffer[self._released : upto]
        self._released = upto
        self.text = self._buffer[:upto]
        return out

    @property
    def _max_stop(self) -> int:
        return max((len(s) for s in self.stop), default=1)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)
