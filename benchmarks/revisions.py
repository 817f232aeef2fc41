"""A benchmark's figures for the code at another git revision, in the same run as this tree's
(this CPU's speed drifts from day to day: only a before and after measured together count).

The revision is checked out in a temporary worktree and the script runs in a process of its
own with that tree first on PYTHONPATH: the revision's own copy of the script (its figures as
it measured them then), or this tree's (the same measurement, where the script uses only
interfaces both revisions have).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def output_at(revision: str, script: str, argv: list[str], own_script: bool = True) -> str:
    """The standard output of benchmarks/`script` run on the code at `revision`; with
    `own_script` False, this tree's copy of the script runs on that code."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], cwd=ROOT, check=True)
        try:
            path = (tree if own_script else ROOT) / "benchmarks" / script
            run = subprocess.run([sys.executable, str(path), *argv], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                                 capture_output=True, text=True, check=True)
            return run.stdout
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)
