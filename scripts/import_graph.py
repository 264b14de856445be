"""The import graph of `adaserve/`, and its picture as a Mermaid `graph` block.

`python scripts/import_graph.py` prints the graph between groups of modules (a
subpackage is one node, top-level modules are grouped by what they do) to stdout, in a
fixed order, ready to paste into a Markdown file. `tests/test_layering.py` uses
`module_graph` and `find_cycles` to hold the package free of import cycles.

Every import counts, at module level or inside a function, but those under
`if TYPE_CHECKING:` (they never run). `from pkg import name` imports the submodule
`pkg.name` when there is one, else the module `pkg`. A module named only in a string
(cli.py's subcommand table, imported when the subcommand runs) is not seen.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "adaserve"

# Top-level modules of `adaserve/`, grouped by what they do; a module named nowhere here
# is its own node, so a new module shows up rather than vanishing.
GROUPS: dict[str, tuple[str, ...]] = {
    "cli": ("__main__", "cli"),
    "config": ("__init__", "config"),
    # The serving engine: the package, its assembly, and what wraps or measures it.
    "engine": (
        "engine",
        "engine_build",
        "stream",
        "calibration",
        "checks",
        "cpu_load",
        "fallback",
        "isolation",
        "timing",
        "torch_thread",
    ),
    "metrics": ("metrics",),
    # The papers' stages: policy (A(r), Algorithms 1 and 2, d/w, batch planning, method
    # choice, routing), drafting (the interface and the drafters), target (the interface,
    # the runner's forward, verification, sampling, logits processing).
    "policy": (
        "scheduler",
        "selection",
        "slo",
        "latency",
        "adaptive",
        "batching",
        "methods",
        "routing",
    ),
    "drafting": ("drafter", "speculate", "eagle_drafter", "ngram", "features"),
    "target": ("target", "runner_target", "verify", "sampling", "logits_process", "grammar"),
    "requests": ("request", "chat", "demo_prompts", "detokenize"),
    "tree": ("tree",),
}


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of `package` under `root`: dotted name -> file."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of `tree` at any depth, less `if TYPE_CHECKING:` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch runs
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name` or its longest prefix that is a module of the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(name: str, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` imports."""
    path = modules[name]
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = name.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for target in targets:
            known = _known(target, modules)
            if known is not None and known != name:
                out.add(known)
    return out


def module_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every module of `package`."""
    modules = module_names(root, package)
    return {name: imports_of(name, modules) for name in modules}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module,
    each as [a, b, ..., a], sorted: empty when the graph is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the package is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(_shortest_cycle(graph, c) for c in components)


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    best: list[str] | None = None
    for start in sorted(component):
        # breadth-first from start back to start, inside the component
        parent: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        found = v
                        break
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        if found is None:
            continue
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycle = [*reversed(path), start]
        if best is None or len(cycle) < len(best):
            best = cycle
    assert best is not None
    return best


def group_of(name: str, package: str = PACKAGE, root: Path = ROOT) -> str:
    """The picture's node for module `name`: its subpackage, or its top-level group."""
    parts = name.split(".")[1:]
    if len(parts) > 1 or (parts and (root / package / parts[0]).is_dir()):
        return parts[0]  # a subpackage (adaserve.rpc.v1 is rpc)
    top = parts[0] if parts else "__init__"
    return next((g for g, members in GROUPS.items() if top in members), top)


def mermaid(graph: dict[str, set[str]], root: Path = ROOT) -> str:
    """The graph between groups as a Mermaid `graph LR` block, edges sorted."""
    edges: set[tuple[str, str]] = set()
    nodes: set[str] = set()
    for source, targets in graph.items():
        a = group_of(source, root=root)
        nodes.add(a)
        edges.update((a, b) for t in targets if (b := group_of(t, root=root)) != a)
    lines = ["```mermaid", "graph LR"]
    lines += [f"    {n}" for n in sorted(nodes)]
    lines += [f"    {a} --> {b}" for a, b in sorted(edges)]
    lines.append("```")
    return "\n".join(lines)


def within(graph: dict[str, set[str]], package: str) -> str:
    """The graph among the modules of one subpackage (e.g. adaserve.engine) as a Mermaid
    `graph TD` block, each node the module's last name."""
    prefix = package + "."
    inside = {m for m in graph if m.startswith(prefix)}
    lines = ["```mermaid", "graph TD"]
    lines += [f"    {m.removeprefix(prefix)}" for m in sorted(inside)]
    for m in sorted(inside):
        for t in sorted(graph[m] & inside):
            lines.append(f"    {m.removeprefix(prefix)} --> {t.removeprefix(prefix)}")
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`--root DIR`: the graph of another checkout (e.g. `git archive REV adaserve`
    unpacked there), to draw a before-and-after. `--within PACKAGE` (e.g.
    adaserve.engine): the graph among that subpackage's modules instead."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[args.index("--root") + 1]) if "--root" in args else ROOT
    graph = module_graph(root)
    if "--within" in args:
        print(within(graph, args[args.index("--within") + 1]))
    else:
        print(mermaid(graph, root))
    cycles = find_cycles(graph)
    for cycle in cycles:
        print("import cycle: " + " -> ".join(cycle), file=sys.stderr)
    return 1 if cycles else 0


if __name__ == "__main__":
    raise SystemExit(main())
