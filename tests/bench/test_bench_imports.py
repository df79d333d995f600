"""The bench package's modules import one another without a cycle.

Every ``import`` counts, lazy ones inside functions too: a lazy import only
hides a cycle from the interpreter (``bench/trace.py`` and ``bench/vllm.py``
once imported each other that way). Parses the sources with ``ast``; imports
nothing; well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nvmetier.bench

PACKAGE = "nvmetier.bench"


def import_graph(folder: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: {modules of the same package it imports}}`` for every
    ``*.py`` in ``folder`` (``__init__`` is the package itself)."""
    names = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from . import x / from .x import y
                    base = package if node.level == 1 else package.rsplit(".", node.level - 1)[0]
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                targets = [mod] if mod != package else [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                if t == package:
                    edges.add("__init__")
                elif t.startswith(package + "."):
                    sub = t[len(package) + 1 :].split(".")[0]
                    edges.add(sub if sub in names else "__init__")
        edges.discard(path.stem)
        graph[path.stem] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_bench_package_has_no_import_cycle() -> None:
    graph = import_graph(Path(nvmetier.bench.__file__).parent)
    assert {"clock", "trace", "vllm", "main"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in nvmetier/bench: " + " -> ".join(cycle or [])


def test_the_shared_pieces_have_one_home() -> None:
    graph = import_graph(Path(nvmetier.bench.__file__).parent)
    assert "trace" not in graph["vllm"] and "vllm" not in graph["trace"]
    assert "clock" in graph["vllm"] and "clock" in graph["trace"]
    from nvmetier.bench import clock, common, trace, vllm

    # Re-exported where the bench and its tests import them: one object each.
    assert vllm._TierClock is clock._TierClock is trace._TierClock
    assert nvmetier.bench._TierClock is clock._TierClock
    assert trace.parse_tier_options is common.parse_tier_options


def test_a_lazy_cycle_is_found(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("from pkg.a import f\n")
    (tmp_path / "a.py").write_text("import os\n\ndef f():\n    from pkg.b import g\n    return g\n")
    (tmp_path / "b.py").write_text("from pkg import c\n")
    (tmp_path / "c.py").write_text("def h():\n    from .a import f\n")
    (tmp_path / "d.py").write_text("from pkg.c import h\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"__init__": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"c"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("X = 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None
