"""A worker's OpenMP threads sleep at barriers (OMP_WAIT_POLICY=PASSIVE) unless its environment
sets a policy: set at the worker's start, before torch loads libgomp (which reads it then).
Each case runs in a fresh interpreter, as a worker process starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW_POLICY = (
    "import os, sys\n"
    "from worker.queue.consumer import _passive_openmp\n"
    "assert 'torch' not in sys.modules\n"
    "_passive_openmp()\n"
    "print(os.environ.get('OMP_WAIT_POLICY'))\n"
)


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE"), ("passive", "passive")])
def test_the_worker_start_sets_a_passive_wait_policy_unless_one_is_given(given: str | None, seen: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", SHOW_POLICY], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == seen
