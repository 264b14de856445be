"""A drafter that knows the answer, for lossless tests of features a random drafter
would never get accepted under (grammars, penalties on a random model).

Given each request's reference output (what plain decoding produced), it proposes below
the root a chain of the reference's next tokens, each one replaced by a random token
with probability `p_wrong`, and a random sibling at every level: trees with accepted
paths of every length, rejected branches, and branches a grammar prunes.
"""

from __future__ import annotations

import numpy as np

from adaserve.drafter import DraftUpdate
from adaserve.tree import CandidateTree


class OracleDrafter:
    def __init__(
        self,
        reference: dict[str, tuple[int, list[int]]],  # id -> (prompt length, output)
        vocab_size: int,
        p_wrong: float = 0.2,
        seed: int = 0,
    ) -> None:
        self.reference = reference
        self.vocab_size = vocab_size
        self.p_wrong = p_wrong
        self.rng = np.random.default_rng(seed)
        self.history: dict[str, list[int]] = {}
        self.proposed = 0  # drafted nodes proposed, for tests to check drafting happened

    def speculate(
        self, updates: list[DraftUpdate], depth: int, width: int, stop_prob: float = 0.0
    ) -> list[CandidateTree]:
        trees = []
        for u in updates:
            new = np.asarray(u.new_tokens).tolist()
            hist = [] if len(new) == u.total_len else self.history.get(u.id, [])
            hist = self.history[u.id] = hist + new
            root = hist[-1] if hist else 0
            if u.ingest or depth == 0 or u.id not in self.reference:
                trees.append(CandidateTree.root_only(root))
                continue
            prompt_len, out = self.reference[u.id]
            tokens, parents, logprobs = [root], [-1], [0.0]
            at = 0
            for d in range(depth):
                pos = len(hist) - prompt_len + d
                right = out[pos] if pos < len(out) else int(self.rng.integers(self.vocab_size))
                tok = right if self.rng.random() >= self.p_wrong else self._random(right)
                tokens += [tok, self._random(tok)]
                parents += [at, at]
                logprobs += [np.log(0.7), np.log(0.2)]
                at = len(tokens) - 2
            self.proposed += len(tokens) - 1
            trees.append(CandidateTree.build(tokens, parents, np.asarray(logprobs, np.float32)))
        return trees

    def _random(self, other: int) -> int:
        tok = other
        while tok == other:
            tok = int(self.rng.integers(self.vocab_size))
        return tok

    def release(self, ids: list[str]) -> None:
        for i in ids:
            self.history.pop(i, None)
