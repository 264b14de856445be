"""The layering rule of docs/ARCHITECTURE.md: the core (`adaserve/` but the CLI layer,
`adaserve/cli.py`, `adaserve/__main__.py` and `adaserve/commands/`, and the generated
wire contract `adaserve/rpc/v1/`) imports no transport and no outer layer: no grpc, no
`services`, no `gateway`, no web framework, and not the CLI layer (which would reach
them). Every import counts, at any depth (inside functions and TYPE_CHECKING too)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "adaserve"
OUTSIDE_CORE = ("cli.py", "__main__.py", "commands", "rpc/v1")
FORBIDDEN = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "grpc_status",
    "services",
    "gateway",
    "fastapi",
    "starlette",
    "uvicorn",
    "adaserve.cli",
    "adaserve.commands",
)


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a forbidden module in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from adaserve import cli` imports adaserve.cli
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                found.append((node.lineno, name))
                break
    return sorted(found)


def core_modules() -> list[Path]:
    skip = [CORE / p for p in OUTSIDE_CORE]
    return sorted(
        p
        for p in CORE.rglob("*.py")
        if not any(p == s or s in p.parents for s in skip) and "__pycache__" not in p.parts
    )


def test_the_checker_finds_every_kind_of_import() -> None:
    src = """
import numpy
import grpc
from services.drafter.client import GrpcDrafter
def f():
    import gateway.app
    from fastapi import FastAPI
from adaserve import cli
from adaserve.commands import up
import grpc_health.v1.health_pb2 as health
from adaserve.tree import CandidateTree
"""
    assert [line for line, _ in forbidden_imports(src)] == [3, 4, 6, 7, 8, 9, 10]


def test_the_core_has_many_modules() -> None:
    names = {p.relative_to(CORE).as_posix() for p in core_modules()}
    assert {"engine/core.py", "engine_build.py", "selection.py", "model/runner.py"} <= names
    assert not {"cli.py", "commands/up.py", "rpc/v1/scheduler_pb2_grpc.py"} & names
    assert len(names) > 60


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_module_imports_no_transport(path: Path) -> None:
    assert forbidden_imports(path.read_text(encoding="utf-8")) == []


def test_remote_parts_come_only_from_the_transport_layer() -> None:
    """The core refuses a drafter or scheduler address it has no client for, with the
    way out in the message; services/verifier/wiring.py gives it the gRPC clients."""
    from adaserve.config import Settings
    from adaserve.engine_build import build_drafter, build_scheduler
    from services.drafter.client import GrpcDrafter
    from services.scheduler.client import GrpcScheduler
    from services.verifier import wiring

    s = Settings(
        services={"drafter": "127.0.0.1:9", "scheduler": "127.0.0.1:9"},
        engine={"speculation_timeout_ms": 300.0, "scheduler_timeout_ms": 150.0},
    )
    with pytest.raises(ValueError, match=r"services\.drafter .*services\.verifier\.wiring"):
        build_drafter(s)
    with pytest.raises(ValueError, match=r"services\.scheduler .*services\.verifier\.wiring"):
        build_scheduler(s)
    drafter, scheduler = wiring.build_drafter(s), wiring.build_scheduler(s)
    try:  # gRPC channels connect lazily: nothing is dialled here
        assert isinstance(drafter, GrpcDrafter) and isinstance(scheduler, GrpcScheduler)
        assert drafter.address == scheduler.address == "127.0.0.1:9"
        assert drafter.timeout_s == pytest.approx(0.3)
        assert scheduler.timeout_s == pytest.approx(0.15)
    finally:
        drafter.close()
        scheduler.close()


def test_architecture_module_map_names_every_module() -> None:
    """docs/ARCHITECTURE.md's module map has a line for every module of the three
    packages (generated stubs and package __init__ files aside), so a new module
    comes with its line."""
    doc = (ROOT / "docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    start, end = doc.index("## Module map"), doc.index("## Glossary")
    names = set(re.findall(r"`([\w/.]+\.py)`", doc[start:end]))
    missing = []
    for package in ("adaserve", "services", "gateway"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if path.name == "__init__.py" or "rpc" in rel.parts or "__pycache__" in rel.parts:
                continue
            full, inner = rel.as_posix(), rel.relative_to(package).as_posix()
            if full not in names and inner not in names:
                missing.append(full)
    assert missing == []


def imported_modules(source: str) -> set[str]:
    """Every absolute module name `source` imports (`from a import b` counts a and a.b)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in helper modules (`tests/_*.py`) and `conftest.py`: a
    test module importing another would run that module's tests' imports and fixtures
    from the wrong place, and couples tests that should be read alone."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name in imported_modules(path.read_text(encoding="utf-8")):
            parts = name.split(".")
            if parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:]):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []
    # The checker sees both import forms.
    assert "tests.test_x" in imported_modules("import tests.test_x")
    assert "tests.test_x.f" in imported_modules("from tests.test_x import f")


# The policy (the paper's tree, A(r), Algorithms 1 and 2, depth/width, batch planning,
# method choice, routing), the interfaces of the drafter and the target, the engine with
# its planner, and the simulator that runs it on modelled parts: none needs torch.
TORCH_FREE = (
    "adaserve.tree",
    "adaserve.slo",
    "adaserve.selection",
    "adaserve.adaptive",
    "adaserve.batching",
    "adaserve.latency",
    "adaserve.methods",
    "adaserve.routing",
    "adaserve.scheduler",
    "adaserve.drafter",
    "adaserve.target",
    "adaserve.engine.planner",
    "adaserve.engine",
    "adaserve.sim.driver",
)


def test_the_policy_the_engine_and_the_simulator_import_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now raises\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    __import__(name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_torch_free_check_fails_on_a_module_that_imports_torch() -> None:
    code = "import sys\nsys.modules['torch'] = None\nimport adaserve.runner_target\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "torch" in proc.stderr


def _import_graph():
    """scripts/import_graph.py, the one home of the import-graph reader."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cycle_finder_sees_every_kind_of_import(tmp_path: Path) -> None:
    graph = _import_graph()
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.sub import b  # a submodule, inside a function\n",
        "sub/__init__.py": "",
        "sub/b.py": "from ..c import X  # relative\n",
        "c.py": "import pkg.a\nX = 1\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "e.py": "import pkg.d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    g = graph.module_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.sub.b"} and g["pkg.sub.b"] == {"pkg.c"}
    assert g["pkg.d"] == set()  # under TYPE_CHECKING: never runs
    assert graph.find_cycles(g) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_no_import_cycles() -> None:
    """No module of adaserve/ imports itself through others, at any depth (function-level
    imports included: a lazy import hides a cycle, it does not break it)."""
    graph = _import_graph()
    cycles = graph.find_cycles(graph.module_graph(ROOT, "adaserve"))
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """One idea per module, a few hundred lines at most; generated stubs aside."""
    long = []
    for package in ("adaserve", "services", "gateway"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "rpc/v1" in rel:
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_MODULE_LINES:
                long.append(f"{rel}: {lines} lines")
    assert long == []


def test_the_engine_step_reads_as_the_papers_loop() -> None:
    """`Engine.step` and the loop it runs (`_iterate`) stay short: one call per phase,
    the phases in their own modules (adaserve/engine/)."""
    import inspect

    from adaserve.engine.core import Engine

    for method in (Engine.step, Engine._iterate):
        lines = inspect.getsource(method).splitlines()
        body = [line for line in lines[1:] if line.strip()]
        assert len(body) <= 15, f"{method.__name__}: {len(body)} lines"
