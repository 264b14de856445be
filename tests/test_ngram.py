"""The n-gram drafter (adaserve/ngram.py) and merged trees (tree.merge_trees): matches
against a brute-force search, the trie's probabilities against counted continuations,
the Drafter protocol's state rules, and the union's contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.drafter import DrafterStateLost, DraftUpdate
from adaserve.ngram import NgramDrafter, NgramParams, SuffixIndex, continuation_tree
from adaserve.tree import CandidateTree, TreeError, merge_trees


def _brute_matches(toks: list[int], n: int, max_n: int) -> tuple[list[int], int]:
    """Continuation starts of the longest earlier occurrences (>= n) of the suffix."""
    length = len(toks)
    best, starts = 0, []
    for end in range(length - 1):
        k = 0
        while k < max_n and end - k >= 0 and toks[end - k] == toks[length - 1 - k]:
            k += 1
        if k < n:
            continue
        if k > best:
            best, starts = k, [end + 1]
        elif k == best:
            starts.append(end + 1)
    return starts, best


@settings(max_examples=300, deadline=None)
@given(
    toks=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    n=st.integers(1, 3),
    max_n=st.integers(3, 8),
    split=st.integers(0, 60),
)
def test_suffix_index_finds_the_longest_earlier_matches(toks, n, max_n, split):
    idx = SuffixIndex(n)
    split = min(split, len(toks))  # tokens arrive in two pieces: the index is incremental
    idx.extend(np.asarray(toks[:split], np.int32))
    idx.extend(np.asarray(toks[split:], np.int32))
    assert idx.tokens.tolist() == toks
    starts, k = idx.matches(scan=1000, max_n=max_n)
    want, best = _brute_matches(toks, n, max_n)
    assert (starts.tolist(), k) == (want, best)


def _paths(tree: CandidateTree) -> dict[tuple[int, ...], float]:
    """token path below the root -> f"""
    f = tree.path_probs()
    out, path = {}, {0: ()}
    for v in range(1, len(tree)):
        path[v] = (*path[int(tree.parents[v])], int(tree.tokens[v]))
        out[path[v]] = float(f[v])
    return out


def test_trie_probabilities_are_smoothed_agreement_fractions():
    # "5 6" occurs three times before the end; it was followed by 7 8, 7 9 and 1 2.
    toks = np.array([5, 6, 7, 8, 0, 5, 6, 7, 9, 0, 5, 6, 1, 2, 0, 5, 6], np.int32)
    starts = np.array([2, 7, 12])
    tree = continuation_tree(toks, starts, depth=2, width=8, prior_count=1.0)
    tree.validate()
    got = _paths(tree)
    assert got[(7,)] == pytest.approx(2 / 4)  # 2 of 3 continuations, + 1 pseudo-count
    assert got[(1,)] == pytest.approx(1 / 4)
    assert got[(7, 8)] == pytest.approx(2 / 4 * 1 / 3)  # 1 of the 2 through "7"
    assert got[(7, 9)] == pytest.approx(2 / 4 * 1 / 3)
    assert got[(1, 2)] == pytest.approx(1 / 4 * 1 / 2)
    assert int(tree.tokens[0]) == 6  # rooted at the last committed token


def test_width_keeps_the_most_likely_nodes_per_level_and_stop_prob_ends_the_tree():
    toks = np.array([5, 6, 7, 8, 0, 5, 6, 7, 9, 0, 5, 6, 1, 2, 0, 5, 6], np.int32)
    starts = np.array([2, 7, 12])
    tree = continuation_tree(toks, starts, depth=2, width=1, prior_count=1.0)
    assert list(_paths(tree)) == [(7,), (7, 8)]  # ties: the earlier token
    assert (np.bincount(tree.depths()) <= 1).all()
    short = continuation_tree(toks, starts, depth=2, width=8, prior_count=1.0, stop_prob=0.2)
    assert max(len(p) for p in _paths(short)) == 1  # level 2's best f is 1/6 < 0.2


def test_a_loop_is_drafted_as_deep_as_asked():
    toks = np.array([1, 2, 3, 1, 2, 3, 1, 2], np.int32)
    drafter = NgramDrafter(NgramParams(min_n=2))
    (tree,) = drafter.speculate([DraftUpdate("a", toks, len(toks))], depth=7, width=1)
    assert tree.tokens.tolist() == [2, 3, 1, 2, 3, 1, 2, 3]
    assert (tree.parents[1:] == np.arange(len(tree) - 1)).all()
    f = tree.path_probs()
    assert (np.diff(f) < 0).all()  # each level is one more guess


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.integers(0, 4), min_size=2, max_size=50),
    depth=st.integers(0, 6),
    width=st.integers(1, 4),
)
def test_trees_keep_the_candidate_tree_contract(toks, depth, width):
    drafter = NgramDrafter(NgramParams(min_n=1, max_n=6))
    arr = np.asarray(toks, np.int32)
    (tree,) = drafter.speculate([DraftUpdate("a", arr, len(arr))], depth, width)
    tree.validate()
    assert int(tree.tokens[0]) == toks[-1]
    d = tree.depths()
    assert d.max() <= depth and (np.bincount(d)[1:] <= width).all()
    f = tree.path_logprobs()
    assert (f[1:] <= f[tree.parents[1:]]).all()
    # Every drafted path occurred in the context right after a match of the suffix (or
    # continues a repeat past the end); here: its first token followed the last token.
    firsts = {toks[i + 1] for i in range(len(toks) - 1) if toks[i] == toks[-1]}
    assert {int(t) for t in tree.tokens[tree.parents == 0]} <= firsts


def test_protocol_state_rules():
    drafter = NgramDrafter()
    prompt = np.array([4, 5, 6, 4, 5], np.int32)
    # a prompt chunk is ingested: root-only tree, state kept
    (t,) = drafter.speculate([DraftUpdate("a", prompt[:3], 3, ingest=True)], 4, 1)
    assert len(t) == 1
    (t,) = drafter.speculate([DraftUpdate("a", prompt[3:], 5)], 4, 1)
    assert t.tokens.tolist()[:2] == [5, 6]
    # unknown ids and drifted lengths are reported together, nothing changes
    with pytest.raises(DrafterStateLost) as lost:
        drafter.speculate(
            [DraftUpdate("a", np.array([7], np.int32), 9), DraftUpdate("b", prompt[1:], 5)],
            4,
            1,
        )
    assert lost.value.ids == ["a", "b"]
    assert drafter.num_sequences == 0  # stale state dropped: the resync rebuilds it
    (t,) = drafter.speculate([DraftUpdate("a", prompt, 5)], 4, 1)  # the full history
    assert t.tokens.tolist()[:2] == [5, 6]
    drafter.release(["a"])
    assert drafter.num_sequences == 0
    with pytest.raises(ValueError, match="width"):
        drafter.speculate([DraftUpdate("a", prompt, 5)], 2, 0)


def test_no_match_gives_a_root_only_tree():
    (t,) = NgramDrafter().speculate([DraftUpdate("a", np.arange(10, dtype=np.int32), 10)], 4, 2)
    assert t.tokens.tolist() == [9]


# ---- merged trees ----------------------------------------------------------------------


@st.composite
def _trees(draw, root: int = 3):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [root] + [draw(st.integers(0, 3)) for _ in range(1, n)]
    logq = [0.0] + [draw(st.floats(-5.0, 0.0)) for _ in range(1, n)]
    return CandidateTree.build(tokens, parents, logq)


@settings(max_examples=300, deadline=None)
@given(a=_trees(), b=_trees())
def test_merged_tree_is_the_union_with_the_larger_f(a, b):
    m = merge_trees(a, b)
    m.validate()
    lf = m.path_logprobs()
    assert (lf[1:] <= lf[m.parents[1:]]).all()
    pa, pb, pm = _paths_max(a), _paths_max(b), _paths_max(m)
    assert set(pm) == set(pa) | set(pb)
    for path, f in pm.items():
        assert f == pytest.approx(max(pa.get(path, 0.0), pb.get(path, 0.0)), rel=1e-5)


def _paths_max(tree: CandidateTree) -> dict[tuple[int, ...], float]:
    """Like _paths, but a tree may hold one path twice (duplicate siblings): max f."""
    f = tree.path_probs()
    out: dict[tuple[int, ...], float] = {}
    path = {0: ()}
    for v in range(1, len(tree)):
        path[v] = (*path[int(tree.parents[v])], int(tree.tokens[v]))
        out[path[v]] = max(out.get(path[v], 0.0), float(f[v]))
    return out


def test_merging_needs_the_same_root():
    with pytest.raises(TreeError, match="roots differ"):
        merge_trees(CandidateTree.root_only(1), CandidateTree.chain([2, 3], [0.0, -1.0]))


# ---- teacher-forced measurement (adaserve measure-drafter --drafter ngram) -------------


def test_measured_steps_match_drafting_from_scratch_at_every_step():
    """ngram_matches feeds the drafter only the new tokens; drafting from the whole
    history afresh at each step (a new drafter each time) must give the same steps."""
    from adaserve.distill.data import Sequences
    from adaserve.distill.measure import ngram_matches, summarize

    rng = np.random.default_rng(3)
    seqs, prompt_lens = [], []
    for _ in range(6):
        base = rng.integers(0, 6, 12).tolist()
        prompt = base + base[:5]  # the continuation repeats the prompt, then wanders
        seqs.append(prompt + base[5:] + rng.integers(0, 6, 10).tolist())
        prompt_lens.append(len(prompt))
    data = Sequences(
        tokens=np.concatenate(seqs).astype(np.int32),
        offsets=np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int64),
        prompt_lens=np.asarray(prompt_lens, np.int32),
        topk_ids=np.zeros((0, 1), np.int32),
        topk_logp=np.zeros((0, 1), np.float16),
    )
    matches, steps = ngram_matches(data, depth=4)
    for i in range(len(data)):
        seq, pl = data.seq(i), int(data.prompt_lens[i])
        pos, want = pl, 0
        while pos < len(seq):
            update = DraftUpdate("x", seq[:pos], pos)
            (tree,) = NgramDrafter().speculate([update], 4, 1)
            k = 0
            while k < len(tree) - 1 and pos + k < len(seq) and tree.tokens[1 + k] == seq[pos + k]:
                k += 1
            pos, want = pos + min(k + 1, len(seq) - pos), want + 1
        assert steps[i] == want
        first = [
            len(t := NgramDrafter().speculate([DraftUpdate("x", seq[:p], p)], 1, 1)[0]) > 1
            and int(t.tokens[1]) == int(seq[p])
            for p in range(pl, len(seq))
        ]
        assert matches[i].tolist() == first
    acc = summarize(matches, 4, steps)
    assert acc.mean_emitted == pytest.approx(acc.tokens / sum(steps)) and acc.mean_emitted > 1.5


@pytest.mark.slow
def test_measure_drafter_reports_each_drafter_on_the_same_continuations(tmp_path):
    """`adaserve measure-drafter --drafter embedded ngram`: one target generation, one
    table per drafter over the same continuation tokens, per category."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    heldout = Path(__file__).parents[1] / "adaserve" / "distill" / "prompts" / "heldout.jsonl"
    rows = [json.loads(line) for line in heldout.read_text().splitlines() if line.strip()]
    picked = [next(r for r in rows if r["category"] == c) for c in ("summarize", "chat")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in picked))
    args = ["--prompts", str(prompts), "--max-new-tokens", "16", "--cost-steps", "0", "--json"]
    args += ["--draft-context", "4", "100000"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaserve",
            "measure-drafter",
            "--drafter",
            "embedded",
            "ngram",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(out.stdout)
    model, ngram = result["drafters"]["embedded"], result["drafters"]["ngram"]
    assert model["tokens"] == ngram["tokens"] > 0
    assert set(model["by_category"]) == set(ngram["by_category"]) == {"summarize", "chat"}
    assert 1.0 <= ngram["mean_emitted"] <= 5.0 and ngram["drafter"] == "ngram"
    assert ngram["drafter_ms_per_draft"] > 0
    # --draft-context: the model drafter again, reading only each prompt's last N tokens,
    # on the same continuations; a window longer than every prompt is the whole prompt.
    windows = model["by_draft_context"]
    assert windows["4"]["tokens"] == windows["100000"]["tokens"] == model["tokens"]
    assert windows["100000"]["top1_agreement"] == model["top1_agreement"]
    assert windows["4"]["top1_agreement"] < model["top1_agreement"]
    assert "by_draft_context" not in ngram


def test_longer_matches_are_trusted_more():
    """One earlier occurrence either way; the smoothing shrinks with the match length m
    (and grows m by one per level): q = 1 / (1 + 2.2 / m ** 1.6)."""
    drafter = NgramDrafter()

    def chain(toks: list[int]) -> np.ndarray:
        arr = np.asarray(toks, np.int32)
        (tree,) = drafter.speculate([DraftUpdate("a", arr, len(arr))], 2, 1)
        return np.exp(tree.logprobs[1:])

    def q(m: int) -> float:
        return 1.0 / (1.0 + 2.2 / m**1.6)

    assert chain([7, 9, 8, 5, 6, 8]) == pytest.approx([q(1), q(2)])  # "8" matched: k = 1
    long = chain([1, 2, 3, 4, 8, 5, 6, 1, 2, 3, 4, 8])  # "1 2 3 4 8" matched: k = 5
    assert long == pytest.approx([q(5), q(6)])
    assert q(1) == pytest.approx(0.31, abs=0.01) and q(6) == pytest.approx(0.89, abs=0.01)
