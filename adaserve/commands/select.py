"""`adaserve select [--policy P] FILE.json`: token selection for a JSON batch.

Input (FILE may be `-` for stdin):
    {"budget": int, "depth": int, "width": int, "n_max": int?, "order": str?,
     "t_spec_ms": float,
     "requests": [{"id": str, "tpot_slo_ms": float, "elapsed_ms": float, "decoded": int,
                   "tree": {"tokens": [int], "parents": [int], "logprobs": [float]}}]}
`logprobs[i]` is node i's conditional log-probability given its parent (0.0 for the
root). Output:
    {"requests": [{"id", "selected": [node indices, ascending], "a", "a_cap",
                   "expected_accepted"}], "budget_used": int}
or `{"invalid": true}` when policy `optimal` finds no feasible allocation. Bad input:
one line on stderr naming the field, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from adaserve.selection import POLICIES, RequestProgress, SelectionError, SelectionParams, select
from adaserve.tree import CandidateTree, TreeError

EXIT_BAD_INPUT = 2


class InputError(ValueError):
    """The JSON does not have the documented shape; the message names the field."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE.json", help="the batch as JSON, or - for stdin")
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="adaserve",
        help="selection policy (default: adaserve)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        doc = _load(args.file)
        requests, trees, params = parse_batch(doc, args.policy)
        selection = select(requests, trees, params)
    except (InputError, SelectionError, TreeError) as exc:
        print(f"adaserve select: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if selection.invalid:
        out: dict[str, Any] = {"invalid": True}
    else:
        out = {
            "requests": [
                {
                    "id": r.id,
                    "selected": sel.tolist(),
                    "a": float(a),
                    "a_cap": float(cap),
                    "expected_accepted": float(acc),
                }
                for r, sel, a, cap, acc in zip(
                    requests,
                    selection.selected,
                    selection.a,
                    selection.a_cap,
                    selection.expected_accepted,
                    strict=True,
                )
            ],
            "budget_used": selection.budget_used,
        }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _load(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON: {exc}") from exc


def parse_batch(
    doc: Any, policy: str
) -> tuple[list[RequestProgress], list[CandidateTree], SelectionParams]:
    """The documented JSON batch as select() arguments; InputError names a bad field."""
    _expect(doc, dict, "the top level", "an object")
    params = SelectionParams(
        budget=_get(doc, "budget", int, "budget"),
        depth=_get(doc, "depth", int, "depth"),
        t_spec_ms=float(_get(doc, "t_spec_ms", float, "t_spec_ms")),
        policy=policy,
        n_max=_get(doc, "n_max", int, "n_max", optional=True),
        order=_get(doc, "order", str, "order", optional=True) or "descending_a",
    )
    width = _get(doc, "width", int, "width")
    if width < 1:
        raise InputError(f"width: must be a positive integer, got {width}")
    items = _get(doc, "requests", list, "requests")
    requests, trees = [], []
    for k, item in enumerate(items):
        where = f"requests[{k}]"
        _expect(item, dict, where, "an object")
        requests.append(
            RequestProgress(
                id=_get(item, "id", str, f"{where}.id"),
                tpot_slo_ms=float(_get(item, "tpot_slo_ms", float, f"{where}.tpot_slo_ms")),
                elapsed_ms=float(_get(item, "elapsed_ms", float, f"{where}.elapsed_ms")),
                decoded=_get(item, "decoded", int, f"{where}.decoded"),
            )
        )
        tree = _get(item, "tree", dict, f"{where}.tree")
        arrays = [
            _get_list(tree, name, kind, f"{where}.tree.{name}")
            for name, kind in (("tokens", int), ("parents", int), ("logprobs", float))
        ]
        try:
            trees.append(CandidateTree.build(*arrays))
        except TreeError as exc:
            raise InputError(f"{where}.{exc}") from exc
        except OverflowError as exc:
            raise InputError(f"{where}.tree: integer out of int32 range") from exc
    return requests, trees, params


_KIND_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
}


def _get(obj: dict, key: str, kind: type, where: str, *, optional: bool = False) -> Any:
    if key not in obj or (optional and obj[key] is None):
        if optional:
            return None
        raise InputError(f"{where}: missing")
    value = obj[key]
    _expect(value, kind, where, _KIND_NAMES[kind])
    return value


def _get_list(obj: dict, key: str, kind: type, where: str) -> list:
    values = _get(obj, key, list, where)
    for i, v in enumerate(values):
        _expect(v, kind, f"{where}[{i}]", _KIND_NAMES[kind])
    return values


def _expect(value: Any, kind: type, where: str, what: str) -> None:
    # JSON numbers: ints are acceptable floats; booleans are never numbers.
    ok = isinstance(value, int | float) if kind is float else isinstance(value, kind)
    if not ok or (kind in (int, float) and isinstance(value, bool)):
        raise InputError(f"{where}: expected {what}, got {json.dumps(value)[:40]}")
