"""Each concept depends one way: no module of the package imports (at the top, inside a
function, or for type hints alone) a module that imports it back, directly or through
others. A cycle is how a "helper" import turns two concepts into one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "partial_fc_mx"


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports by relative import}."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    graph = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
                for imported in [target, *(f"{target}.{a.name}" for a in node.names)]:
                    if imported in files and imported != name:
                        graph[name].add(imported)
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    paths, seen = [[start]], set()
    while paths:
        path = paths.pop()
        for nxt in graph[path[-1]]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    return None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "partial_fc_mx.pfc.centers" in graph and graph["partial_fc_mx.pfc.centers"]
    cycles = [cycle for name in sorted(graph) if (cycle := cycle_through(graph, name))]
    assert not cycles, " | ".join(" -> ".join(cycle) for cycle in cycles[:5])


def test_a_cycle_is_found(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None
