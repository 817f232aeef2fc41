"""What the documentation tells a user to paste, read from the documentation itself, so the
tests that run it (tests/api/test_docs.py, tests/queue/test_queue_docs.py) follow every edit:

- the code blocks marked `<!-- tested: NAME -->` on the line before their fence (README.md's
  client quickstart, docs/engine.md's offline quickstart);
- every command line of a program (`genq`, `arq`) shown in README.md and docs/*.md (lines of
  plain or shell code blocks, and inline code), and those docker-compose.yml and the
  Dockerfile run.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml  # type: ignore[import-untyped]  # (no stubs installed)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ENGINE_DOC = ROOT / "docs" / "engine.md"
MARKED = re.compile(r"^<!-- tested: ([\w-]+)[^\n]*-->\n```\w*\n(.*?)^```", re.M | re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL_LANGUAGES = ("", "sh", "bash", "shell", "console")
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # inline code, at most over one line break
COMMENT = re.compile(r"\s+#.*$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Command:
    """One command line as shown: where (file:line) and its text, usage brackets and all."""

    where: str
    text: str

    @property
    def argv(self) -> tuple[str, ...]:
        return tuple(shlex.split(self.text))

    @property
    def flags(self) -> list[str]:
        """Every --flag the line names, bracketed usage included."""
        return FLAG.findall(self.text)


def marked_block(name: str, path: Path = README) -> str:
    """The code of the one block marked `<!-- tested: name -->`."""
    found = [code for mark, code in MARKED.findall(path.read_text()) if mark == name]
    assert len(found) == 1, f"{path.name}: {len(found)} code blocks marked 'tested: {name}'"
    return found[0]


def docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def command_lines(program: str) -> list[Command]:
    """Every command line of `program` the docs show or the container files run."""
    found = [c for path in docs() for c in _markdown_commands(path, program)]
    return found + _container_commands(program)


def _markdown_commands(path: Path, program: str) -> list[Command]:
    text = path.read_text()
    found: list[Command] = []
    prose = list(text)
    for block in FENCE.finditer(text):
        prose[block.start():block.end()] = re.sub(r"[^\n]", " ", block.group(0))  # keeps line numbers
        first_line = text.count("\n", 0, block.start(2)) + 1
        for offset, line in enumerate(block.group(2).splitlines()):
            where = f"{path.relative_to(ROOT)}:{first_line + offset}"
            found += [Command(where, s) for s in _inline(program, line)]  # in a comment too
            if block.group(1) in SHELL_LANGUAGES:
                found += [Command(where, part) for part in _parts(program, COMMENT.sub("", line))]
    rest = "".join(prose)
    for span in SPAN.finditer(rest):
        where = f"{path.relative_to(ROOT)}:{rest.count(chr(10), 0, span.start()) + 1}"
        found += [Command(where, part) for part in _parts(program, " ".join(span.group(1).split()))]
    return found


def _inline(program: str, line: str) -> list[str]:
    return [part for span in SPAN.findall(line) for part in _parts(program, span)]


def _parts(program: str, line: str) -> list[str]:
    """`a; b` is two command lines; only those that run `program` count."""
    parts = (part.strip() for part in line.split(";"))
    return [part for part in parts if part.split(" ", 1)[0] == program and " " in part]


def _container_commands(program: str) -> list[Command]:
    """The compose services' commands and health checks, and the Dockerfile's CMD."""
    found: list[Command] = []
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        check = (service.get("healthcheck") or {}).get("test")
        runs = [service.get("command"), check[1:] if isinstance(check, list) and check[0] == "CMD" else None]
        found += [Command(f"docker-compose.yml:{name}", shlex.join(argv)) for argv in runs
                  if isinstance(argv, list) and argv[0] == program]
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith(("CMD [", "ENTRYPOINT [")):
            argv = json.loads(line.split(" ", 1)[1])
            if argv[0] == program:
                found.append(Command("Dockerfile", shlex.join(argv)))
    return found
