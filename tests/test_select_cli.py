"""`adaserve select`: the installed command on JSON files and stdin."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adaserve.cli import main
from tests._selection import FIG2_R0, FIG2_R1

ADASERVE = Path(sys.executable).with_name("adaserve")


def tree_json(tree) -> dict:
    return {
        "tokens": tree.tokens.tolist(),
        "parents": tree.parents.tolist(),
        "logprobs": [float(x) for x in tree.logprobs],
    }


# Figure 2 of paper 000: A(r0) = (106 + 10) / 10 - 10 = 1.6, A(r1) = 1.8.
FIG2 = {
    "budget": 8,
    "depth": 3,
    "width": 2,
    "t_spec_ms": 10.0,
    "requests": [
        {
            "id": "r0",
            "tpot_slo_ms": 10.0,
            "elapsed_ms": 106.0,
            "decoded": 10,
            "tree": tree_json(FIG2_R0),
        },
        {
            "id": "r1",
            "tpot_slo_ms": 10.0,
            "elapsed_ms": 108.0,
            "decoded": 10,
            "tree": tree_json(FIG2_R1),
        },
    ],
}


def adaserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ADASERVE), "select", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_figure_2_from_a_file(tmp_path):
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(FIG2))
    done = adaserve(str(path))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["budget_used"] == 8
    assert [r["id"] for r in out["requests"]] == ["r0", "r1"]
    assert [r["selected"] for r in out["requests"]] == [[0, 1, 3, 5], [0, 1, 2, 3]]
    np.testing.assert_allclose([r["a"] for r in out["requests"]], [1.6, 1.8])
    np.testing.assert_allclose([r["a_cap"] for r in out["requests"]], [1.6, 1.8])
    np.testing.assert_allclose(
        [r["expected_accepted"] for r in out["requests"]], [2.4, 2.25], rtol=1e-6
    )


def test_stdin_policies_and_invalid_optimal():
    done = adaserve("--policy", "equal", "-", stdin=json.dumps(FIG2))
    assert done.returncode == 0, done.stderr
    assert [r["selected"] for r in json.loads(done.stdout)["requests"]] == [
        [0, 1, 3, 5],
        [0, 1, 2, 3],
    ]
    batch = copy.deepcopy(FIG2)
    batch["requests"][0]["elapsed_ms"] = 200.0  # A(r0) = 11: more than the tree holds
    done = adaserve("--policy", "optimal", "-", stdin=json.dumps(batch))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"invalid": True}


def test_policy_paper_is_algorithm_2_as_published():
    def selected(*args: str, batch: dict) -> list[list[int]]:
        done = adaserve(*args, "-", stdin=json.dumps(batch))
        assert done.returncode == 0, done.stderr
        return [r["selected"] for r in json.loads(done.stdout)["requests"]]

    # Figure 2 is the paper's own example: Algorithm 2 gives the figure's trees.
    assert selected("--policy", "paper", batch=FIG2) == [[0, 1, 3, 5], [0, 1, 2, 3]]
    # A(r0) = 11 (A_cap 4): its 5 best nodes (n_max = ceil(1.2 * 8 / 2)) sum to 2.6.
    hopeless = copy.deepcopy(FIG2)
    hopeless["requests"][0]["elapsed_ms"] = 200.0
    # Algorithm 2 serves the largest A first: r0 spends n_max nodes chasing 4, r1
    # reaches 1.8 with the last two slots and the throughput phase has none left.
    assert selected("--policy", "paper", batch=hopeless) == [[0, 1, 2, 3, 5], [0, 1, 2]]
    # adaserve's triage keeps r0 to its root in the SLO phase; the throughput phase
    # then gives the 4 slots left to the best nodes of both.
    assert selected(batch=hopeless) == [[0, 1, 3, 5], [0, 1, 2, 3]]


def test_bad_input_exits_2_without_a_traceback(tmp_path):
    done = adaserve("-", stdin='{"budget": 8,')
    assert done.returncode == 2
    assert "invalid JSON" in done.stderr and "Traceback" not in done.stderr
    done = adaserve(str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "No such file" in done.stderr
    assert "Traceback" not in done.stderr


def _with(path: str, value) -> dict:
    """FIG2 with the field at a dotted path (list indices as numbers) set to value."""
    doc = copy.deepcopy(FIG2)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = doc
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("budget", _DELETE, "budget: missing"),
        ("budget", "8", "budget: expected an integer"),
        ("budget", 0, "budget: must be a positive integer"),
        ("budget", 1, "budget: 1 is smaller than the number of roots (2)"),
        ("depth", 2.5, "depth: expected an integer"),
        ("width", 0, "width: must be a positive integer"),
        ("t_spec_ms", True, "t_spec_ms: expected a number"),
        ("order", "sideways", "order: 'sideways' is not one of"),
        ("n_max", 0, "n_max: must be a positive integer"),
        ("requests", {}, "requests: expected a list"),
        ("requests.1", 3, "requests[1]: expected an object"),
        ("requests.0.id", 7, "requests[0].id: expected a string"),
        ("requests.1.tpot_slo_ms", 0, "requests[1].tpot_slo_ms: must be a positive finite number"),
        ("requests.1.elapsed_ms", -5, "requests[1].elapsed_ms: must be finite and >= 0"),
        ("requests.0.decoded", -1, "requests[0].decoded: must be finite and >= 0"),
        ("requests.0.tree", _DELETE, "requests[0].tree: missing"),
        (
            "requests.1.tree.parents",
            [-1, 0, 0, 1, 9, 3, 4],
            "requests[1].tree.parents: parent of node 4 is 9",
        ),
        ("requests.1.tree.parents", [-1, 0, 0], "requests[1].tree: array lengths disagree"),
        (
            "requests.0.tree.logprobs",
            [0, 0.5, 0, 0, 0, 0, 0],
            "requests[0].tree.logprobs: positive",
        ),
        ("requests.0.tree.tokens", [], "requests[0].tree.tokens: empty tree"),
        (
            "requests.0.tree.tokens",
            [1, 2, 3, 4, 5, 6, 2**40],
            "requests[0].tree: integer out of int32 range",
        ),
        (
            "requests.0.tree.logprobs",
            [0, "x", 0, 0, 0, 0, 0],
            "requests[0].tree.logprobs[1]: expected a number",
        ),
    ],
)
def test_bad_fields_are_named(tmp_path, capsys, path, value, message):
    file = tmp_path / "batch.json"
    file.write_text(json.dumps(_with(path, value)))
    assert main(["select", str(file)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_nan_logprob_in_json(tmp_path, capsys):
    file = tmp_path / "batch.json"
    file.write_text(json.dumps(_with("requests.0.tree.logprobs.1", float("nan"))))
    assert "NaN" in file.read_text()  # Python's json writes (and reads) the NaN literal
    assert main(["select", str(file)]) == 2
    assert "logprobs: NaN" in capsys.readouterr().err
