"""The package's structure, as docs/architecture.md draws it, held against the code.

- Each concept depends one way: no module of the package imports (at the top, inside a
  function, or for type hints alone; relatively or by its absolute name) a module that
  imports it back, directly or through others. A cycle is how a "helper" import turns
  two concepts into one.
- The wings are layered: docs/architecture.md lists them from the top down, and a
  module imports only from its own wing and the wings below it.
- Every module is named in its wing's section of docs/architecture.md (an __init__.py
  only when it holds more than its docstring), so the page cannot fall behind the code.
- No two classes of the package share a name.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "partial_fc_mx"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def package_files(package: Path = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file}."""
    files = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    return files


def imported_names(path: Path, name: str) -> list[str]:
    """Every dotted name module `name` (at `path`) imports, as far as its text says:
    `from . import a`, `from ..b import c`, `from pkg.b import c`, `import pkg.b`."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names += [target, *(f"{target}.{alias.name}" for alias in node.names)]
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}; importing the package itself (the
    parent of every `from . import x`) is not an edge."""
    files = package_files(package)
    root = package.name
    graph = {name: set() for name in files}
    for name, path in files.items():
        for imported in imported_names(path, name):
            if imported in files and imported not in (name, root):
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


def wing_of(module: str) -> str:
    """partial_fc_mx.pfc.margins.adaface -> "pfc/"; partial_fc_mx.train -> "train.py"."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return f"{parts[0]}/" if (PACKAGE / parts[0]).is_dir() else f"{parts[0]}.py"


def documented_wings(text: str) -> list[tuple[list[str], set[str]]]:
    """docs/architecture.md's sections from the top down: (the wings its heading names in
    backticks, the module paths its body names in backticks)."""
    sections = []
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        wings = re.findall(r"`([\w.]+/?)`", heading)
        if wings:
            sections.append((wings, set(re.findall(r"`([\w/]+\.py)`", body))))
    return sections


def layer_problems(graph: dict[str, set[str]], sections: list) -> list[str]:
    """Imports from a higher wing and modules whose wing has no section."""
    height = {wing: len(sections) - i for i, (wings, _) in enumerate(sections) for wing in wings}
    height["__init__.py"] = len(sections) + 1  # the package's own names: above everything
    problems = [f"{name}: its wing {wing_of(name)} has no section in docs/architecture.md"
                for name in sorted(graph) if wing_of(name) not in height]
    for name in sorted(graph):
        for imported in sorted(graph[name]):
            low, high = wing_of(name), wing_of(imported)
            if low in height and high in height and height[high] > height[low]:
                problems.append(f"{name} imports {imported} from a higher wing ({high} is "
                                f"above {low})")
    return problems


def undocumented(files: dict[str, Path], sections: list) -> list[str]:
    """Modules not named in their wing's section (an __init__.py that holds only its
    docstring needs no row: the docstring is the wing's paragraph)."""
    named: dict[str, set[str]] = {}
    for wings, paths in sections:
        for path in paths:
            named.setdefault(path, set()).update(wings)
    missing = []
    for path in sorted(files.values()):
        relative = path.relative_to(PACKAGE).as_posix()
        body = ast.parse(path.read_text()).body
        if path.name == "__init__.py" and len(body) <= 1:
            continue
        name = ".".join(["partial_fc_mx", *path.relative_to(PACKAGE).with_suffix("").parts])
        if wing_of(name.removesuffix(".__init__")) not in named.get(relative, ()):
            missing.append(relative)
    return missing


def class_names(files: dict[str, Path]) -> dict[str, list[str]]:
    """{class name: the modules that define a class of that name}."""
    found: dict[str, list[str]] = {}
    for name, path in sorted(files.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(name)
    return found


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "partial_fc_mx.pfc.rows" in graph["partial_fc_mx.pfc.partial_fc"]
    cycles = [cycle for name in sorted(graph) if (cycle := cycle_through(graph, name))]
    assert not cycles, " | ".join(" -> ".join(cycle) for cycle in cycles[:5])


def test_no_module_imports_from_a_wing_above_it():
    sections = documented_wings(ARCHITECTURE.read_text())
    assert [wings for wings, _ in sections][-1][0] == "errors.py"  # the bottom, as drawn
    assert not layer_problems(import_graph(), sections)


def test_every_module_is_named_in_its_wings_section_of_the_architecture_page():
    missing = undocumented(package_files(), documented_wings(ARCHITECTURE.read_text()))
    assert not missing, f"add these to their wing's table in docs/architecture.md: {missing}"


def test_no_two_classes_share_a_name():
    shared = {name: where for name, where in class_names(package_files()).items()
              if len(where) > 1}
    assert not shared, shared


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert cycle_through(graph, "d") is None


@pytest.fixture
def toy_package(tmp_path):
    """partial_fc_mx-like: low/ at the bottom, high.py above it."""
    root = tmp_path / "partial_fc_mx"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text('"""Toy."""\n')
    (root / "low" / "__init__.py").write_text('"""Low."""\n')
    (root / "low" / "base.py").write_text("X = 1\n")
    (root / "high.py").write_text("from .low.base import X\n")
    return root


def test_absolute_and_relative_imports_are_both_read(toy_package):
    (toy_package / "low" / "other.py").write_text(
        "import partial_fc_mx.high\nfrom partial_fc_mx.low import base\n")
    graph = import_graph(toy_package)
    assert graph["partial_fc_mx.high"] == {"partial_fc_mx.low.base"}
    assert graph["partial_fc_mx.low.other"] == {
        "partial_fc_mx.high", "partial_fc_mx.low", "partial_fc_mx.low.base"}


def test_an_import_from_a_higher_wing_is_found(toy_package, monkeypatch):
    import test_architecture as here

    monkeypatch.setattr(here, "PACKAGE", toy_package)
    sections = documented_wings("## `high.py`: top\n| `high.py` | |\n"
                                "## `low/`: bottom\n| `low/base.py` | |\n")
    assert not layer_problems(import_graph(toy_package), sections)
    (toy_package / "low" / "base.py").write_text("def f():\n    from partial_fc_mx import high\n")
    assert layer_problems(import_graph(toy_package), sections) == [
        "partial_fc_mx.low.base imports partial_fc_mx.high from a higher wing (high.py is "
        "above low/)"]


def test_a_module_missing_from_the_page_is_found(toy_package, monkeypatch):
    import test_architecture as here

    monkeypatch.setattr(here, "PACKAGE", toy_package)
    page = "## `high.py`: top\n| `high.py` | |\n## `low/`: bottom\n| `low/base.py` | |\n"
    assert not undocumented(package_files(toy_package), documented_wings(page))
    (toy_package / "low" / "new.py").write_text("Y = 2\n")
    assert undocumented(package_files(toy_package), documented_wings(page)) == ["low/new.py"]
    # named, but in another wing's section
    moved = page.replace("| `low/base.py` |", "").replace("| `high.py` | |",
                                                           "| `high.py` | |\n| `low/base.py` | |")
    assert "low/base.py" in undocumented(package_files(toy_package), documented_wings(moved))


def test_the_public_names_import_without_loading_mxnet_first():
    """`from partial_fc_mx import PartialFC` is the stable import of docs/partial_fc_api.md;
    `import partial_fc_mx` alone (every command line starts with it) loads no MXNet."""
    code = ("import sys, partial_fc_mx; assert 'mxnet' not in sys.modules; "
            "from partial_fc_mx import AdamW, PartialFC, SGD; "
            "print(PartialFC.__module__, AdamW.__module__, SGD.__module__)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["partial_fc_mx.pfc.partial_fc",
                                     "partial_fc_mx.pfc.center_optimizers.adamw",
                                     "partial_fc_mx.pfc.center_optimizers.sgd"]
    with pytest.raises(AttributeError, match="has no attribute 'Partial'"):
        import partial_fc_mx

        partial_fc_mx.Partial  # noqa: B018 (the missing name is the point)
