"""The api/ package's layout, read from the source with `ast` (every module, every import,
those inside functions too): routes import services, never other routes; nothing in api/
imports torch or `worker`; no two api modules import each other, however far round. The
runtime twin, test_api_errors.py::test_the_api_never_imports_torch_or_worker, sees only what
creating the app imports; these see every module, each import where it is written."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api"
ROUTER_INCLUDER = "api.main"  # the one module that includes the routers


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(API.rglob("*.py"))}


def _imports(nodes: list[ast.stmt] | list[ast.AST], top_level: bool) -> Iterator[tuple[str, int]]:
    """(each module named by an import, its line): `from a import b` names a and, where b is a
    module of ours, a.b. At top level, `if TYPE_CHECKING:` imports are left out (they never run)."""
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node.lineno
            yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names
                        if f"{node.module}.{alias.name}" in MODULES)
        elif not top_level:
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _imports([*node.body, *node.orelse], top_level)
        elif isinstance(node, ast.Try):
            yield from _imports([*node.body, *node.orelse, *node.finalbody,
                                 *(s for h in node.handlers for s in h.body)], top_level)


def _all_imports(path: Path) -> list[tuple[str, int]]:
    return list(_imports(list(ast.walk(ast.parse(path.read_text()))), top_level=False))


def _top_level_imports(path: Path) -> set[str]:
    return {name for name, _ in _imports(ast.parse(path.read_text()).body, top_level=True) if name in MODULES}


def test_the_check_reads_every_api_module() -> None:
    # (a check that read nothing would pass whatever the layout)
    assert {"api.main", "api.routes.chat", "api.chat", "api.parsers.tool_calls", "api.cli.serve"} <= MODULES.keys()
    assert "api.chat" in {name for name, _ in _all_imports(MODULES["api.routes.chat"])}
    assert "api.routes.chat" in {name for name, _ in _all_imports(MODULES["api.main"])}
    assert _circle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle_from("a", {"a": {"b"}, "b": set()}) is None


def test_only_the_app_imports_routes() -> None:
    """What two endpoints share lives in a service module (api.chat, api.completions,
    api.pooling, ...) that both routes import."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for module, path in MODULES.items() if module != ROUTER_INCLUDER
           for name, line in _all_imports(path) if name == "api.routes" or name.startswith("api.routes.")]
    assert not bad, bad


def test_the_api_never_imports_torch_or_worker() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for path in MODULES.values() for name, line in _all_imports(path)
           if name.split(".")[0] in ("torch", "worker")]
    assert not bad, bad


def test_no_import_circles_in_the_api() -> None:
    graph = {module: _top_level_imports(path) - {module, "api"} for module, path in MODULES.items()}
    circles = [circle for module in graph if (circle := _circle_from(module, graph))]
    assert not circles, circles


def _circle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from `start` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for imported in graph[module]:
            if imported == start:
                return [*path, start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, [*path, imported]))
    return None
