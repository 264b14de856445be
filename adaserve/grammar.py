"""Structured output: a grammar mask on the target at every tree node (llguidance).

`GrammarBackend` compiles a request's `StructuredOutput` (JSON schema, any JSON object,
regex, choice, Lark/GBNF grammar) for the target's tokenizer; `Constraint` is one
request's matcher. Each iteration the engine asks the constraint for the mask of every
node of the request's selected tree: the matcher advances along each path from the
root and rolls back on the way up, so every node's mask is the one plain decoding would
have after that path. Drafted branches the grammar rejects are pruned before
verification (they could never be accepted: their parent's choice is always a token
the grammar allows). Once tokens are emitted the matcher consumes them.

Why llguidance (issue 24 compared the three engines made for this): it is one 3 MB
abi3 wheel with no dependencies; xgrammar 0.2 requires torch, transformers and triton
(a CUDA package, pulled in on every Linux x86-64 install), and outlines-core compiles a
regex index per schema up front (slow for large schemas, no Lark grammars). llguidance
computes masks lazily (tens of microseconds per token on SmolLM2's 49k vocabulary), has
rollback, and is one of vLLM's structured-output backends ("guidance").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from adaserve.request import StructuredOutput
from adaserve.tree import CandidateTree

if TYPE_CHECKING:  # llguidance is imported where it is used: structured output only
    from llguidance._lib import JsonCompileOptions

# Output in json.dumps's own layout (", " and ": " and no other whitespace): a model's
# natural JSON, and a small model cannot wander into endless whitespace.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarBackend:
    """Compiles structured-output requests for one tokenizer. Thread-safe: the verifier
    validates on its tokenizer thread, the engine builds matchers on its own."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._ll: Any = None
        self._lock = threading.Lock()
        # The verifier compiles at submit to validate; the engine compiles again to build
        # the matcher: the second time is a lookup.
        self._compiled: dict[tuple[str, str], str] = {}

    @property
    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer, built on first use (about 0.5 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.hf_tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll

    def compile(self, so: StructuredOutput) -> str:
        """The llguidance grammar of `so`; ValueError naming its field when invalid."""
        key = (so.kind, so.spec)
        with self._lock:
            hit = self._compiled.get(key)
        if hit is not None:
            return hit
        grammar = self._compile(so)
        with self._lock:
            if len(self._compiled) >= 256:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = grammar
        return grammar

    def _compile(self, so: StructuredOutput) -> str:
        import llguidance

        try:
            if so.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_OPTIONS
                )
            elif so.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.loads(so.spec), defaults=JSON_OPTIONS
                )
            elif so.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(so.spec)
            elif so.kind == "choice":
                choices = json.loads(so.spec)
                if not (
                    isinstance(choices, list)
                    and choices
                    and all(isinstance(c, str) and c for c in choices)
                ):
                    raise ValueError("must be a non-empty list of non-empty strings")
                grammar = llguidance.grammar_from("choice", so.spec)
            else:  # "grammar": Lark, or GBNF (llama.cpp's), told apart by llguidance
                grammar = llguidance.grammar_from("grammar", so.spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{so.field}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer
        )
        if is_error:
            raise ValueError(f"{so.field}: invalid {so.kind}: {messages[0] if messages else ''}")
        if not self._startable(grammar):
            raise ValueError(f"{so.field}: no output of this model can match it")
        return grammar

    def _startable(self, grammar: str) -> bool:
        """Whether this vocabulary can begin an output of `grammar`. A grammar of
        characters the tokenizer cannot spell may still show a token in its first mask
        that llguidance then refuses to consume (the schema fuzzer found one), so the
        first allowed token is tried (on a throwaway matcher: a refused token leaves it in
        error). An end-of-text allowed at once counts as a start."""
        import llguidance

        probe = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint8)
        allowed = np.nonzero(np.unpackbits(mask, bitorder="little"))[0]
        if any(int(t) in self.eos_token_ids for t in allowed):
            return True
        return bool(allowed.size) and bool(probe.consume_token(int(allowed[0])))

    def constraint(self, so: StructuredOutput, stop_ids: Sequence[int]) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.compile(so), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{so.field}: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, stop_ids)


class Constraint:
    """One request's grammar state: a matcher that has consumed its committed output.

    Stop tokens (eos, stop_token_ids) end the output and are never consumed: the
    grammar allows eos only where it may end, and nothing is emitted after a stop.
    """

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.stop_ids = frozenset(int(t) for t in stop_ids)

    def _mask(self) -> np.ndarray:
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        out = np.zeros(self.words, dtype=np.int32)
        n = min(self.words, raw.shape[0])
        out[:n] = raw[:n]
        return out

    @staticmethod
    def allows(mask: np.ndarray, token: int) -> bool:
        word = token >> 5
        return word < mask.shape[0] and bool((int(mask[word]) >> (token & 31)) & 1)

    def tree_masks(self, tree: CandidateTree) -> tuple[CandidateTree, np.ndarray]:
        """(the tree without the branches the grammar rejects, int32 [nodes, words]: the
        grammar's mask at each of its nodes, node order). The matcher ends where it was."""
        n = len(tree)
        children: list[list[int]] = [[] for _ in range(n)]
        for v in range(1, n):
            children[int(tree.parents[v])].append(v)
        masks: dict[int, np.ndarray] = {}
        # Depth-first: roll back to the node's parent, advance into the node, compute its
        # mask. Everything on the stack hangs off the current path, so rolling back to
        # the parent's depth puts the matcher at the parent's state. A node whose token
        # is a stop keeps a zero mask (nothing follows it) and no children.
        stack: list[tuple[int, int]] = [(0, 0)]  # (node, matcher depth at its parent)
        consumed = 0
        while stack:
            v, at = stack.pop()
            if consumed > at:
                self.matcher.rollback(consumed - at)
                consumed = at
            if v and int(tree.tokens[v]) in self.stop_ids:
                masks[v] = np.zeros(self.words, dtype=np.int32)
                continue
            if v:
                if not self.matcher.consume_token(int(tree.tokens[v])):
                    raise RuntimeError(
                        f"grammar refused an allowed token: {self.matcher.get_error()}"
                    )
                consumed += 1
            mask = self._mask()
            masks[v] = mask
            for c in reversed(children[v]):
                if self.allows(mask, int(tree.tokens[c])):
                    stack.append((c, consumed))
        if consumed:
            self.matcher.rollback(consumed)
        keep = np.array(sorted(masks), dtype=np.int64)
        stacked = np.stack([masks[int(v)] for v in keep])
        return (tree if keep.shape[0] == n else tree.subtree(keep)), stacked

    def advance(self, tokens: Sequence[int]) -> bool:
        """Consume emitted tokens (up to the first stop token); False if the grammar
        refused one (it cannot, as every emitted token was drawn under its mask)."""
        for t in tokens:
            if int(t) in self.stop_ids:
                return True
            if not self.matcher.consume_token(int(t)):
                return False
        return True


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face tokenizer. Byte-level and SentencePiece-style
    tokenizers are read natively; any other (a character-level test tokenizer) through
    each token's decoded text."""
    import llguidance
    import llguidance.hf

    eos_list = list(eos) or [int(tokenizer.eos_token_id)]
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_list)
    except ValueError:
        pass
    special = set(getattr(tokenizer, "all_special_ids", []) or [])

    class _Decoded:
        def __init__(self) -> None:
            self.eos_token_id = eos_list[0]
            self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
            self.special_token_ids = sorted(special)
            self.tokens = [
                (
                    tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])
                ).encode()
                for i in range(len(tokenizer))
            ]

        def __call__(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Decoded()), n_vocab=vocab_size, eos_token=eos_list
    )
