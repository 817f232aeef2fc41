"""Every place in the repository the docs name still exists: README.md and docs/*.md are read
as tests/docs_support.py reads them, and each repository path (`worker/core/scheduler.py`,
`api/routes/`, `docs/queue.md`, in code or prose), each module named with dots
(`kernels.fused_moe`, `worker.sample.logits_processors:NoRepeatNGram`) and each Lua script
(`STEP_LUA`) must be found. docs/architecture.md maps every concept to its module, so a move
that forgets the docs fails here, naming the file and line that went stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_support import ROOT, docs

PACKAGES = ("producer", "worker", "api", "kernels", "benchmarks")
# a repository path: a top folder, then path characters, ending on a name or a slash
PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join((*PACKAGES, 'tests', 'docs'))})/[\w./-]*[\w/])")
DOTTED = re.compile(rf"`((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?::(\w+))?(?:\(\))?`")
LUA = re.compile(r"`(\w+_LUA)`")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1}"


def named_paths() -> list[tuple[str, str]]:
    """(file:line, path) for every repository path the docs name."""
    return [(where(doc, text, m.start()), m.group(1))
            for doc in docs() for text in [doc.read_text()] for m in PATH.finditer(text)]


def module_file(dotted: str) -> tuple[Path, list[str]]:
    """The file of the longest module prefix of `dotted`, and the names after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[cut:]
    raise AssertionError(f"no module {parts[0]}")


def defines(source: Path, name: str) -> bool:
    """Whether the module's source has `name` (defined, imported or exported lazily, as
    `worker.WorkerSettings` is): read, not imported, so no torch is needed."""
    return re.search(rf"\b{name}\b", source.read_text()) is not None


def test_the_docs_name_repository_paths() -> None:
    """The check below sees the architecture's table (a regex that matched nothing would pass)."""
    named = {path for place, path in named_paths() if place.startswith("docs/architecture.md")}
    assert {"worker/core/scheduler.py", "worker/queue/publisher.py", "api/relay.py"} <= named


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_name_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = [f"{where(doc, text, m.start())}: {m.group(1)}" for m in PATH.finditer(text)
               if not (ROOT / m.group(1)).exists()]
    assert missing == [], "paths named in the docs that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_the_docs_name_with_dots_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = []
    for m in DOTTED.finditer(text):
        source, rest = module_file(m.group(1))
        names = rest + ([m.group(2)] if m.group(2) else [])
        if len(names) > 1 or (names and not defines(source, names[0])):
            missing.append(f"{where(doc, text, m.start())}: {m.group(0)} ({source.relative_to(ROOT)} has no {names})")
    assert missing == [], "modules named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_lua_script_the_docs_name_is_defined() -> None:
    sources = "\n".join(p.read_text() for pkg in PACKAGES[:4] for p in (ROOT / pkg).rglob("*.py"))
    defined = set(re.findall(r"^(\w+_LUA)\s*=", sources, re.M))
    named = {(where(doc, text, m.start()), m.group(1))
             for doc in docs() for text in [doc.read_text()] for m in LUA.finditer(text)}
    assert any(place.startswith("docs/architecture.md") for place, _ in named)
    assert sorted(f"{place}: {name}" for place, name in named if name not in defined) == []


OUTSIDE = ("../" + "shared", "DESIGN" + ".md")  # (spelled apart, so this file does not name them)


def test_nothing_points_outside_the_repository() -> None:
    """The design is docs/architecture.md: no file sends a reader to a document a user of the
    repository never sees."""
    top = [p for p in ROOT.iterdir() if p.is_file() and p.suffix in ("", ".md", ".toml", ".yml", ".cfg")]
    files = top + [p for folder in (*PACKAGES, "tests", "docs") for p in (ROOT / folder).rglob("*")
                   if p.suffix in (".py", ".md", ".txt", ".toml") and p.is_file()]
    assert len(files) > 100
    found = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in OUTSIDE if name in p.read_text(errors="replace")]
    assert found == []
