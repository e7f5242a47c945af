"""The worker's OpenMP spin (worker_svc.process_env): short enough that a worker sharing its
cores with other processes does not burn its partner thread's share spinning.

At libgomp's 30,000 the worker's steps ran 2-10x slower whenever other processes were busy on
the same 2 cores, and a fan-out's prompts looked slow for whatever they had in common at the
time (a shared prompt prefix, say); process_env.py gives the measurements."""

import os
import subprocess
import sys
from pathlib import Path

from worker_svc.process_env import OPENMP_SPIN_COUNT, WORKER_ENV

ROOT = Path(__file__).resolve().parents[2]
# The most spin measured to keep the worker's step fast beside busy neighbours.
MAX_SPIN = 1000


def test_the_spin_before_sleeping_is_short() -> None:
    assert int(WORKER_ENV["GOMP_SPINCOUNT"]) == OPENMP_SPIN_COUNT
    assert 0 < OPENMP_SPIN_COUNT <= MAX_SPIN


def test_a_worker_process_runs_with_it() -> None:
    """What libgomp reads in a worker started without GOMP_SPINCOUNT of its own."""
    code = "import os, worker_svc.__main__; print(os.environ['GOMP_SPINCOUNT'])"
    environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, check=True,
                          capture_output=True, text=True, timeout=120)
    assert 0 < int(done.stdout.strip()) <= MAX_SPIN
