"""Tree verification against an exact "path model": logits are a pure function of the
token path, so speculative and sequential decoding see bit-identical distributions and
losslessness can be asserted exactly, without a neural network."""

import functools
import itertools

import numpy as np
import pytest
import torch

from adaserve.request import SamplingParams
from adaserve.sampling import TokenRng, filtered_probs, row_params
from adaserve.tree import CandidateTree
from adaserve.verify import verify_batch, verify_tree
from tests._stats import chi_square_pvalue, single_thread

GREEDY = SamplingParams(max_tokens=1000)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@functools.lru_cache(maxsize=65536)
def path_logits(path: tuple[int, ...], vocab: int, scale: float = 2.0) -> torch.Tensor:
    seed = hash(path) & 0x7FFFFFFF  # ints and tuples of ints hash deterministically
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


@functools.lru_cache(maxsize=4096)
def _cached_tree_logits(prefix: tuple[int, ...], tree_key: tuple, vocab: int) -> torch.Tensor:
    tokens, parents = tree_key
    paths: list[tuple[int, ...]] = []
    for v in range(len(tokens)):
        p = parents[v]
        paths.append(prefix if p < 0 else (*paths[p], tokens[v]))
    return torch.stack([path_logits(p, vocab) for p in paths])


def tree_logits(prefix: tuple[int, ...], tree: CandidateTree, vocab: int) -> torch.Tensor:
    """Row v: logits after prefix + path(v) (the root is the prefix's last token)."""
    key = (tuple(tree.tokens.tolist()), tuple(tree.parents.tolist()))
    return _cached_tree_logits(tuple(prefix), key, vocab)


def random_tree(rng: np.random.Generator, root: int, vocab: int, n: int) -> CandidateTree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    tokens = [root] + [int(t) for t in rng.integers(0, vocab, n - 1)]
    return CandidateTree.build(tokens, parents, np.zeros(n))


def greedy_oracle_tree(prefix, vocab, depth, width, wrong=False) -> CandidateTree:
    """Beam-shaped tree whose first branch follows the true greedy path (or never does)."""
    tokens, parents = [prefix[-1]], [-1]
    path = prefix
    prev_layer = [0]
    for _ in range(depth):
        best = int(path_logits(path, vocab).argmax())
        layer = []
        for j in range(width):
            tok = (best + j + (1 if wrong else 0)) % vocab
            tokens.append(tok)
            parents.append(prev_layer[0])
            layer.append(len(tokens) - 1)
        path = (*path, best)
        prev_layer = layer
    return CandidateTree.build(tokens, parents, np.zeros(len(tokens)))


def test_greedy_accepts_the_argmax_path_and_emits_a_bonus():
    vocab, prefix = 16, (3, 1, 4)
    tree = greedy_oracle_tree(prefix, vocab, depth=4, width=3)
    res = verify_tree(tree, tree_logits(prefix, tree, vocab), GREEDY)
    expected, path = [], prefix
    for _ in range(5):
        expected.append(int(path_logits(path, vocab).argmax()))
        path = (*path, expected[-1])
    assert res.emitted_tokens.tolist() == expected
    assert res.accepted_nodes.tolist() == [0, 1, 4, 7, 10]
    assert res.num_accepted_drafts == 4 and res.finish_reason is None


def test_all_branches_wrong_emits_only_the_bonus():
    vocab, prefix = 16, (2, 7)
    tree = greedy_oracle_tree(prefix, vocab, depth=3, width=2, wrong=True)
    res = verify_tree(tree, tree_logits(prefix, tree, vocab), GREEDY)
    assert res.accepted_nodes.tolist() == [0]
    assert res.emitted_tokens.tolist() == [int(path_logits(prefix, vocab).argmax())]


def test_root_only_tree():
    res = verify_tree(CandidateTree.root_only(5), torch.tensor([[0.0, 2.0, 1.0]]), GREEDY)
    assert res.accepted_nodes.tolist() == [0] and res.emitted_tokens.tolist() == [1]


def test_duplicate_siblings_take_the_deepest_path():
    # Nodes 1 and 2 both carry the root's argmax; only node 2 has a correct child.
    tree = CandidateTree.build([9, 1, 1, 0, 2], [-1, 0, 0, 1, 2], np.zeros(5))
    logits = torch.full((5, 4), -5.0)
    logits[0, 1] = logits[1, 3] = logits[2, 2] = logits[4, 0] = 5.0
    logits[3, 0] = 5.0
    for fn in (
        lambda: verify_tree(tree, logits, GREEDY),
        lambda: verify_batch([tree], logits, [GREEDY])[0],
    ):
        res = fn()
        assert res.accepted_nodes.tolist() == [0, 2, 4]
        assert res.emitted_tokens.tolist() == [1, 2, 0]


def _chain(tokens):
    return CandidateTree.chain(tokens, np.zeros(len(tokens)))


def _onehot_logits(next_tokens, vocab=10):
    logits = torch.zeros(len(next_tokens), vocab)
    logits[torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 10.0
    return logits


@pytest.mark.parametrize(
    ("sp", "eos", "max_new", "tokens", "reason"),
    [
        (SamplingParams(max_tokens=100), (4,), None, [2, 4], "stop"),  # eos inside the path
        (SamplingParams(max_tokens=100, ignore_eos=True), (4,), None, [2, 4, 6, 8], None),
        (SamplingParams(max_tokens=100, stop_token_ids=(6,)), (), None, [2, 4, 6], "stop"),
        (SamplingParams(max_tokens=100), (), 2, [2, 4], "length"),
        (SamplingParams(max_tokens=100), (), 4, [2, 4, 6, 8], "length"),  # exactly fills
        (SamplingParams(max_tokens=100), (), 5, [2, 4, 6, 8], None),
        (SamplingParams(max_tokens=100), (8,), 4, [2, 4, 6, 8], "stop"),  # stop on last slot
        (SamplingParams(max_tokens=100), (6,), 2, [2, 4], "length"),  # stop beyond the cap
    ],
)
def test_stop_conditions_truncate(sp, eos, max_new, tokens, reason):
    tree = _chain([1, 2, 4, 6])  # the target agrees with every drafted token
    logits = _onehot_logits([2, 4, 6, 8])
    for res in (
        verify_tree(tree, logits, sp, eos_token_ids=eos, max_new=max_new),
        verify_batch([tree], logits, [sp], eos_token_ids=eos, max_new=[max_new])[0],
    ):
        assert res.emitted_tokens.tolist() == tokens
        assert res.accepted_nodes.tolist() == list(range(len(tokens)))
        assert res.finish_reason == reason


def test_inputs_are_not_mutated():
    rng = np.random.default_rng(0)
    tree = random_tree(rng, 3, 8, 12)
    logits = torch.randn(12, 8)
    copies = (tree.tokens.copy(), tree.parents.copy(), tree.logprobs.copy(), logits.clone())
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    verify_tree(tree, logits, sp, TokenRng(1))
    verify_batch([tree, tree], torch.cat([logits, logits]), [sp, GREEDY], [TokenRng(1), None])
    for a, b in zip(copies, (tree.tokens, tree.parents, tree.logprobs, logits), strict=True):
        assert (a == b).all()


def test_bad_inputs_raise_clear_errors():
    tree = _chain([1, 2])
    with pytest.raises(ValueError, match="3 logit rows"):
        verify_tree(tree, torch.zeros(3, 5), GREEDY)
    with pytest.raises(ValueError, match="max_new"):
        verify_tree(tree, torch.zeros(2, 5), GREEDY, max_new=0)
    with pytest.raises(ValueError, match="logits"):
        verify_batch([tree, tree], torch.zeros(3, 5), [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="sampling params"):
        verify_batch([tree], torch.zeros(2, 5), [GREEDY, GREEDY])


def test_batch_matches_reference_on_random_trees():
    rng = np.random.default_rng(1)
    vocab = 6  # small, so random drafts are often accepted
    for trial in range(30):
        n_req = int(rng.integers(1, 6))
        trees, sps, keys, positions = [], [], [], []
        for _ in range(n_req):
            trees.append(
                random_tree(rng, int(rng.integers(vocab)), vocab, int(rng.integers(1, 15)))
            )
            if rng.random() < 0.5:
                sps.append(SamplingParams(max_tokens=50))
            else:
                sps.append(
                    SamplingParams(
                        temperature=float(rng.uniform(0.3, 1.5)),
                        top_k=int(rng.integers(0, vocab)),
                        top_p=float(rng.uniform(0.5, 1.0)),
                        max_tokens=50,
                    )
                )
            keys.append(int(rng.integers(2**62)))
            positions.append(int(rng.integers(0, 40)))
        logits = torch.randn(sum(len(t) for t in trees), vocab) * 2
        caps = [int(rng.integers(1, 8)) for _ in range(n_req)]
        eos = (int(rng.integers(vocab)),)
        rngs_a = [TokenRng(k, p) for k, p in zip(keys, positions, strict=True)]
        rngs_b = [TokenRng(k, p) for k, p in zip(keys, positions, strict=True)]
        batch = verify_batch(trees, logits, sps, rngs_a, eos_token_ids=eos, max_new=caps)
        start = 0
        for i, t in enumerate(trees):
            ref = verify_tree(
                t,
                logits[start : start + len(t)],
                sps[i],
                rngs_b[i],
                eos_token_ids=eos,
                max_new=caps[i],
            )
            start += len(t)
            assert ref.accepted_nodes.tolist() == batch[i].accepted_nodes.tolist(), trial
            assert ref.emitted_tokens.tolist() == batch[i].emitted_tokens.tolist(), trial
            assert ref.finish_reason == batch[i].finish_reason
            assert rngs_a[i].position == rngs_b[i].position
            if not sps[i].greedy:
                assert rngs_a[i].position == positions[i] + len(ref.emitted_tokens)


def _decode(prefix, vocab, sp, rng, steps, make_tree, accepted=None):
    """Speculative decoding against the path model until `steps` tokens are emitted."""
    out: list[int] = []
    seq = tuple(prefix)
    while len(out) < steps:
        tree = make_tree(seq)
        res = verify_tree(tree, tree_logits(seq, tree, vocab), sp, rng, max_new=steps - len(out))
        out.extend(res.emitted_tokens.tolist())
        seq = seq + tuple(res.emitted_tokens.tolist())
        if accepted is not None:
            accepted.append(res.num_accepted_drafts)
    return out


def test_seeded_sampling_is_identical_with_and_without_speculation():
    vocab = 5
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=1000)
    rng = np.random.default_rng(3)

    def spec_tree(seq):
        # Random trees: any shape, any tokens; seeded output must not depend on them.
        return random_tree(rng, seq[-1], vocab, int(rng.integers(1, 12)))

    for seed in range(5):
        plain = _decode(
            (1, 2), vocab, sp, TokenRng(seed), 30, lambda s: CandidateTree.root_only(s[-1])
        )
        spec = _decode((1, 2), vocab, sp, TokenRng(seed), 30, spec_tree)
        assert plain == spec


@functools.lru_cache(maxsize=4096)
def _draft_tree(seq, vocab, depth, width):
    """A deterministic beam-like draft (top-w continuations under the target's raw
    logits, not its filtered distribution): what a real drafter gives."""
    tokens, parents = [seq[-1]], [-1]
    frontier = [(0, seq)]
    for _ in range(depth):
        nxt = []
        for node, path in frontier:
            q = path_logits(path, vocab)
            for tok in q.topk(width).indices.tolist():
                tokens.append(tok)
                parents.append(node)
                nxt.append((len(tokens) - 1, (*path, tok)))
        frontier = nxt[:width]
    return CandidateTree.build(tokens, parents, np.zeros(len(tokens)))


def test_sampled_two_token_distribution_matches_the_target():
    vocab, prefix = 4, (0, 1)
    sp = SamplingParams(temperature=1.0, top_k=3, max_tokens=1000)

    def target(path):
        x = path_logits(path, vocab)[None]
        return filtered_probs(x, *row_params([sp], [1], x.device))[0].double().numpy()

    p1 = target(prefix)
    exact = np.array(
        [p1[a] * target((*prefix, a))[b] for a, b in itertools.product(range(vocab), repeat=2)]
    )
    n = 4000
    counts = np.zeros(vocab * vocab)
    accepted: list[int] = []
    for k in range(n):
        out = _decode(
            prefix, vocab, sp, TokenRng(k), 2, lambda s: _draft_tree(s, vocab, 2, 2), accepted
        )
        counts[out[0] * vocab + out[1]] += 1
    assert chi_square_pvalue(counts, exact) > 1e-3
    # Both outcomes occur often: drafts accepted and drafts rejected.
    assert 0.2 < np.mean(np.array(accepted) > 0) < 0.95
    # The verifier must also reject impossible tokens outright (top-k removed one).
    assert counts[exact == 0].sum() == 0
