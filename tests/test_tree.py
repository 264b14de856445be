import numpy as np
import pytest

from adaserve.tree import CandidateTree, TreeError


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
