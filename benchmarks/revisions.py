"""A benchmark's output for the code at an older git revision, for `--against REV`: the script
runs in a process of its own from a temporary worktree of that revision, so a before and after
are measured in one run (this CPU's speed drifts from day to day)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def output_at(revision: str, script: Path, argv: list[str], own_copy: bool = True) -> str:
    """What `script` (a file of benchmarks/) prints, run with `argv` on the code at `revision`:
    that revision's copy of the script when `own_copy`, else this tree's (for a script the
    revision does not have yet; it must then use only the interface both trees share)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], cwd=ROOT, check=True)
        try:
            path = tree / script.resolve().relative_to(ROOT) if own_copy else script.resolve()
            run = subprocess.run([sys.executable, str(path), *argv], cwd=tree,
                                 env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"{path.name} at {revision} exited {run.returncode}:\n{run.stderr[-4000:]}")
            return run.stdout
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
