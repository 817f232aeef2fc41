"""The `arq` command lines README.md, docs/*.md and docker-compose.yml show run as written:
each is one arq's own command line takes (`arq worker worker.WorkerSettings`, documented
once, was refused: "Got unexpected extra argument"), its settings resolve to genq's
WorkerSettings, and the one that starts a worker is exactly what these tests' arq workers
run (`python -m arq` is arq's console script): test_queue_failover, test_queue_drain and
test_queue_routing serve jobs through it, so no worker of its own is started here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from arq.cli import cli as arq_cli
from arq.utils import import_string
from docs_support import Command, command_lines
from queue_support import WorkerProcess, worker_env

ARQ_COMMANDS = command_lines("arq")


def test_the_docs_show_the_arq_command_that_starts_a_worker() -> None:
    assert any("--check" not in line.argv for line in ARQ_COMMANDS)


@pytest.mark.parametrize("line", ARQ_COMMANDS, ids=lambda line: f"{line.where} {line.text}")
def test_each_documented_arq_command_line_is_one_arq_takes(line: Command) -> None:
    context = arq_cli.make_context("arq", list(line.argv[1:]))  # click's parse: UsageError if not
    from worker import WorkerSettings

    assert import_string(context.params["worker_settings"]) is WorkerSettings


def test_the_documented_worker_command_is_the_one_the_queue_tests_run(tmp_path: Path) -> None:
    env = worker_env("redis://127.0.0.1:6379/0", tmp_path, "docs", "t-docs:")
    python, dash_m, *command = WorkerProcess(env, tmp_path / "docs.log", via="arq").argv
    assert (python, dash_m) == (sys.executable, "-m")
    starts = [line for line in ARQ_COMMANDS if "--check" not in line.argv]
    assert [line for line in starts if line.argv != tuple(command)] == []
