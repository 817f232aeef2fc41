"""No import circles between genq's modules: the graph of imports among every module of
producer/, worker/, kernels/ and api/ has no cycle.

A circle makes the order modules load in matter (the first one imported sees the other half
empty), hides which module owns a piece, and keeps a package from being read or tested on its
own; the usual patch, moving one import into a function, leaves the circle in place. So an
edge here is every import statement of the project's own modules, wherever it stands: at the
top, inside a function (a lazy import back is still a circle), under try, and under
`if TYPE_CHECKING:` too. A type-only import cannot fail at run time, but it is still one module
depending on another's definitions, and a circle of them is the same tangle in the layering
(the issue that asked for this test counted lora <-> llama <-> linear_attention, closed only by
TYPE_CHECKING imports); the answer is the same as for any circle: the shared types move to a
module both can import (as LoRASlots and LoRAMapping did to worker/model_executor/lora_slots.py).

What counts as an edge from module M:
- `import a.b.c` and `from a.b import c`: to `a.b.c` when that is a module, else to the deepest
  module the name reaches (`from a.b import Name` reaches `a.b`); relative imports resolved.
- Not the packages above the target (`a`, `a.b`), which Python also initialises: every
  submodule import runs them, so counting them would report each package that re-exports its
  submodules, not a dependency anyone wrote. Nor `importlib.import_module` strings
  (worker/__init__'s lazy exports), which ast cannot follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer", "worker", "kernels", "api")


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports `target` at `source_path:line`."""

    source: str
    target: str
    line: int


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module under the packages, dotted name -> file (a package is its __init__)."""
    names: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def _deepest(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is one of `modules`."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (target := _deepest(alias.name, modules)) is not None:
                yield target
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        if (target := _deepest(f"{base}.{alias.name}", modules)) is not None:
            yield target


def import_edges(root: Path, packages: tuple[str, ...]) -> list[Edge]:
    """Every import from one of the packages' modules to another (not to itself)."""
    modules = module_names(root, packages)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, module, path.name == "__init__.py", modules):
                if target != module:
                    edges.append(Edge(module, target, node.lineno))
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted; every one of them holds a circle."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], edges: list[Edge], modules: dict[str, Path]) -> str:
    """A circle's modules and the imports that close it, each with its file and line."""
    members = set(component)
    lines = [" <-> ".join(component)]
    for edge in sorted(set(edges), key=lambda e: (e.source, e.line, e.target)):
        if edge.source in members and edge.target in members:
            path = modules[edge.source]
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            lines.append(f"    {where}:{edge.line} imports {edge.target}")
    return "\n".join(lines)


def test_no_import_circles_between_modules() -> None:
    modules = module_names(ROOT, PACKAGES)
    edges = import_edges(ROOT, PACKAGES)
    assert len(modules) > 100 and len(edges) > 300  # it read the tree, not an empty folder
    found = cycles(edges)
    assert not found, "import circles:\n" + "\n".join(describe(c, edges, modules) for c in found)


def test_the_graph_counts_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The finder on a small package: a circle closed by an import inside a function is found,
    as are one through `from pkg import submodule` and a relative import, and one closed only
    under TYPE_CHECKING; a name imported from a module is an edge to that module."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("thing = 1\n\ndef late():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from .d import x\n")
    (pkg / "d.py").write_text("x = 1\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.f import Y\n")
    (pkg / "f.py").write_text("import pkg.e\nY = int\n")
    edges = import_edges(tmp_path, ("pkg",))
    assert Edge("pkg.b", "pkg.a", 4) in edges
    assert Edge("pkg.a", "pkg.b", 1) in edges
    assert Edge("pkg.c", "pkg.d", 1) in edges
    assert Edge("pkg.e", "pkg.f", 3) in edges
    assert cycles(edges) == [["pkg.a", "pkg.b"], ["pkg.e", "pkg.f"]]
