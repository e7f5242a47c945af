"""What a worker process sets in its own environment before torch loads: `worker_svc/__main__.py`
applies it first thing, and benchmarks that time a worker's step alone (bench/step_profile.py,
bench/split_cost.py) apply it too, so that they run as the service's worker does.

Imports nothing but `os`: it must run before anything imports torch."""

import os

WORKER_ENV = {
    # OpenMP threads that spin-wait at barriers collapse when another process shares the cores
    # (the scheduler, or clients on a small box): 64 streaming clients made each step 10x
    # slower. A short spin, then sleep, keeps quiet-machine speed. libgomp reads this when
    # torch loads it.
    "GOMP_SPINCOUNT": "30000",
}


def apply_worker_env() -> None:
    """Sets each of WORKER_ENV that the environment does not set already."""
    for name, value in WORKER_ENV.items():
        os.environ.setdefault(name, value)
