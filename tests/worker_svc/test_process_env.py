"""The worker's own environment (worker_svc.process_env): set by the worker's entry point before
torch loads, never over what the user set."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import os, worker_svc.__main__; print(os.environ['GOMP_SPINCOUNT'])"


def _probe(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=environ, check=True,
                          capture_output=True, text=True, timeout=120)
    return done.stdout.strip()


def test_the_worker_sets_a_short_openmp_spin_before_torch_loads() -> None:
    from worker_svc.process_env import WORKER_ENV

    assert _probe() == WORKER_ENV["GOMP_SPINCOUNT"]


def test_what_the_user_set_wins() -> None:
    assert _probe(GOMP_SPINCOUNT="12345") == "12345"


def test_setting_it_imports_no_torch() -> None:
    code = ("import sys, worker_svc.process_env as e; e.apply_worker_env(); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False"
