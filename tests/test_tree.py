import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.tree import CandidateTree, TreeBatch, TreeError
from tests._selection_strategies import greedy_key, trees


def test_path_probs_and_depths():
    t = CandidateTree.build([5, 1, 2, 3, 4], [-1, 0, 0, 1, 3], np.log([1, 0.9, 0.1, 0.5, 0.5]))
    assert t.depths().tolist() == [0, 1, 1, 2, 3]
    np.testing.assert_allclose(t.path_probs(), [1, 0.9, 0.1, 0.45, 0.225], rtol=1e-6)


def test_ancestor_mask_and_subtree():
    t = CandidateTree.build([5, 1, 2, 3], [-1, 0, 0, 1], [0, -1, -1, -1])
    m = t.ancestor_mask()
    assert m[3].tolist() == [True, True, False, True]
    s = t.subtree(np.array([0, 1, 3]))
    assert s.tokens.tolist() == [5, 1, 3] and s.parents.tolist() == [-1, 0, 1]
    with pytest.raises(TreeError):
        t.subtree(np.array([0, 3]))


@pytest.mark.parametrize(
    ("tokens", "parents", "logprobs", "field"),
    [
        ([], [], [], "empty"),
        ([1, 2], [-1], [0, 0], "lengths"),
        ([1, 2], [-1, 1], [0, -1], "parents"),
        ([1, 2], [-1, 0], [0, 0.5], "positive"),
        ([1, 2], [-1, 0], [0, float("nan")], "NaN"),
    ],
)
def test_validation_names_the_problem(tokens, parents, logprobs, field):
    with pytest.raises(TreeError, match=field):
        CandidateTree.build(tokens, parents, logprobs)


# --- TreeBatch ------------------------------------------------------------------------


def _buffers(trees: list[CandidateTree]) -> tuple[bytes, bytes, bytes, bytes]:
    cat = lambda name, dt: np.concatenate([getattr(t, name) for t in trees]).astype(dt).tobytes()  # noqa: E731
    sizes = np.array([len(t) for t in trees], dtype="<i4").tobytes()
    return cat("tokens", "<i4"), cat("parents", "<i4"), cat("logprobs", "<f4"), sizes


@settings(max_examples=100, deadline=None)
@given(st.lists(trees(max_nodes=20), min_size=1, max_size=8))
def test_batch_matches_each_tree_bit_for_bit(ts):
    for batch in (TreeBatch.from_trees(ts), TreeBatch.from_buffers(*_buffers(ts))):
        batch.validate()
        assert len(batch) == len(ts) and batch.num_nodes == sum(len(t) for t in ts)
        logf, f, depth = batch.path_logprobs(), batch.path_probs(), batch.depths()
        for k, t in enumerate(ts):
            s = slice(int(batch.offsets[k]), int(batch.offsets[k + 1]))
            assert np.array_equal(logf[s], t.path_logprobs())  # same sums, same order
            assert np.array_equal(f[s], t.path_probs())
            assert np.array_equal(depth[s], t.depths())
            assert np.array_equal(batch.tree(k).parents, t.parents)


@settings(max_examples=100, deadline=None)
@given(st.lists(trees(max_nodes=20), min_size=1, max_size=8))
def test_greedy_order_is_the_documented_key_and_prefixes_are_connected(ts):
    batch = TreeBatch.from_trees(ts)
    keys = batch.greedy_keys()
    cells = [(k, i) for k, t in enumerate(ts) for i in range(len(t))]
    doc_key = {
        (k, i): greedy_key(t, k, i, t.path_logprobs(), t.depths())
        for k, t in enumerate(ts)
        for i in range(len(t))
    }
    assert sorted(cells, key=lambda c: keys[c]) == sorted(cells, key=doc_key.__getitem__)
    rows = batch.greedy_rows()
    for k, t in enumerate(ts):
        order = batch.cells(rows[k, : len(t)]) - k * batch.width
        assert order[0] == 0
        position = np.empty(len(t), dtype=int)
        position[order] = np.arange(len(t))
        assert np.all(position[t.parents[1:]] < position[1:])  # parents come first


def test_ties_in_f_go_to_the_shallower_node():
    # Node 2 (depth 2) and node 3 (depth 1) both have f = 0.5: node 3 first.
    t = CandidateTree.build([1, 2, 3, 4], [-1, 0, 1, 0], [0.0, 0.0, np.log(0.5), np.log(0.5)])
    batch = TreeBatch.from_trees([t])
    order = batch.cells(batch.greedy_rows()[0]).tolist()
    assert order == [0, 1, 3, 2]


def test_ragged_batch_grid_and_padding():
    a = CandidateTree.chain([1, 2, 3], np.log([1.0, 0.5, 0.5]))
    b = CandidateTree.root_only(9)
    batch = TreeBatch.from_trees([a, b, a])
    assert batch.width == 3 and batch.sizes.tolist() == [3, 1, 3]
    np.testing.assert_allclose(batch.path_probs(), [1, 0.5, 0.25, 1, 1, 0.5, 0.25])
    assert batch.path_probs_grid()[1].tolist() == [1.0, 0.0, 0.0]
    assert batch.depths().tolist() == [0, 1, 2, 0, 0, 1, 2]
    assert np.array_equal(batch.from_grid(batch.to_grid(batch.tokens, -1)), batch.tokens)


def test_empty_batch():
    batch = TreeBatch.from_trees([])
    batch.validate()
    assert len(batch) == 0 and batch.num_nodes == 0


def _bad(trees, **replace) -> tuple[bytes, bytes, bytes, bytes]:
    bufs = dict(zip(("tokens", "parents", "logprobs", "sizes"), _buffers(trees), strict=True))
    for name, values in replace.items():
        dtype = "<f4" if name == "logprobs" else "<i4"
        bufs[name] = np.asarray(values, dtype=dtype).tobytes()
    return bufs["tokens"], bufs["parents"], bufs["logprobs"], bufs["sizes"]


_T = CandidateTree.build([5, 1, 2, 3], [-1, 0, 0, 1], np.log([1, 0.5, 0.25, 0.5]))


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        (
            {"parents": [-1, 0, 0, 1, -1, 0, 0, 1, -1, 0, 7, 1]},
            r"trees\[2\].parents: parent of node 2 is 7",
        ),
        (
            {"parents": [-1, 0, 0, 1, -1, 0, 2, 1, -1, 0, 0, 1]},
            r"trees\[1\].parents: parent of node 2 is 2",
        ),
        (
            {"parents": [-1, 0, 0, 1, -1, 0, -1, 1, -1, 0, 0, 1]},
            r"trees\[1\].parents: parent of node 2 is -1",
        ),
        (
            {"parents": [-1, 0, 0, 1, 0, 0, 0, 1, -1, 0, 0, 1]},
            r"trees\[1\].parents: node 0 is the root",
        ),
        (
            {"logprobs": [0, -1, -1, -1, 0, -1, 0.5, -1, 0, -1, -1, -1]},
            r"trees\[1\].logprobs: positive",
        ),
        (
            {"logprobs": [0, -1, -1, -1, 0, -1, -1, -1, 0, -1, -1, np.nan]},
            r"trees\[2\].logprobs: NaN",
        ),
        (
            {"logprobs": [0, -1, -1, -np.inf, 0, -1, -1, -1, 0, -1, -1, -1]},
            r"trees\[0\].logprobs: NaN or infinite",
        ),
        ({"tokens": [1, 2, 3, 4, 1, 2, 3, 4, 1, -2, 3, 4]}, r"trees\[2\].tokens: negative"),
        ({"sizes": [4, 0, 8]}, r"trees\[1\].tokens: empty tree"),
        ({"sizes": [4, 4, 5]}, "lengths disagree"),
        ({"parents": [-1, 0, 0]}, "lengths disagree"),
    ],
)
def test_batch_validation_names_field_and_tree(replace, message):
    with pytest.raises(TreeError, match=message):
        TreeBatch.from_buffers(*_bad([_T, _T, _T], **replace)).validate()


def test_buffers_must_hold_whole_values():
    tok, par, lp, sizes = _buffers([_T])
    with pytest.raises(TreeError, match=r"trees.parents: 15 bytes"):
        TreeBatch.from_buffers(tok, par[:-1], lp, sizes)


def test_from_buffers_does_not_copy():
    bufs = _buffers([_T, _T])
    batch = TreeBatch.from_buffers(*bufs)
    assert not batch.logprobs.flags.owndata and not batch.parents.flags.writeable


def test_greedy_keys_rank_ties_when_depth_and_index_do_not_fit(monkeypatch):
    ts = [_T, CandidateTree.chain([1, 2, 3, 4, 5], [0, -0.5, 0, -0.5, 0]), _T]
    packed = TreeBatch.from_trees(ts)
    packed.greedy_keys()
    monkeypatch.setattr("adaserve.tree._TIE_BITS", 4)
    ranked = TreeBatch.from_trees(ts)
    ranked.greedy_keys()
    assert "rank_to_cell" in ranked._cache and "rank_to_cell" not in packed._cache
    assert np.array_equal(packed.cells(packed.greedy_rows()), ranked.cells(ranked.greedy_rows()))
    flat = lambda b: b.cells(np.sort(b.greedy_keys(), axis=None))  # noqa: E731
    assert np.array_equal(flat(packed), flat(ranked))
