"""What a worker process sets in its own environment before torch loads: `worker_svc/__main__.py`
applies it first thing, and benchmarks that time a worker's step alone (bench/step_profile.py,
bench/split_cost.py) apply it too, so that they run as the service's worker does.

Imports nothing but `os`: it must run before anything imports torch."""

import os

# libgomp's spin, in its own loop iterations, before an idle OpenMP thread sleeps (at a barrier, or
# between parallel regions while the main thread runs the Python between kernels). OpenMP threads
# that spin-wait collapse when other processes share the cores (the scheduler, clients, other
# services on a small box): libgomp's default spin made each step 10x slower under 64 streaming
# clients. 30,000 (kept until 2026-11-29) still burnt a core share a spinning thread's partner
# needed: on 2 shared Zen 5 cores (load average 4-9, other clusters running), a float32 step of 16
# prompts x 3 tokens took 138-538 ms at 30,000 and 39-93 ms at 1,000 (median of 9 steps, 3
# alternating runs each; /tmp benchmark of `ModelRunner.execute`); 0 lost the two threads' overlap
# in quiet moments (64 ms against 39). With the machine quiet (load average 0.4) 1,000 cost about 5%
# on small steps (1 token: 6.5 against 6.2 ms; 16 x 3: 34-35 against 32-33) and nothing on a
# 288-token prefill (169-171 ms against 168-169). Through the services (an HTTP completions fan-out
# of 400 prompts, 16 in flight, beside a greedy control client; 2 alternating clusters each): the
# fan-out took 7.1-7.4 s against 15.8-24.7 s, the worker 6.0-6.9 CPU-s against 13.1-21.0, and the
# control's median 0.48-0.51 s against 0.88-1.77 (worst 0.87 s against 3.9).
# tests/e2e/test_http_fan_out.py's 600 prompts, 2 alternating runs each at load 2.4-6: the control's
# median 0.52 s against 1.14-1.21 (worst 0.77-1.02 against 2.67-3.49); at load 1.2-1.9 the same,
# 0.30 s, either way. libgomp shortens its spin on its own only when its own threads outnumber the
# CPUs; other processes' threads it cannot see.
OPENMP_SPIN_COUNT = 1000

WORKER_ENV = {
    # libgomp reads this when torch loads it.
    "GOMP_SPINCOUNT": str(OPENMP_SPIN_COUNT),
}


def apply_worker_env() -> None:
    """Sets each of WORKER_ENV that the environment does not set already."""
    for name, value in WORKER_ENV.items():
        os.environ.setdefault(name, value)
