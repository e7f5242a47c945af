"""The null model's device: a queue of steps that each keep it busy a fixed time, and the
launched step that is ready only once its emulated work is done.

A GPU runs a step's work once the host has queued it and the step before is done, so a host
that launches ahead keeps it busy, and one that falls behind leaves it idle. `EmulatedDevice`
keeps that clock for `NullRunner` (worker_svc.null_runner): step N's work starts at the later
of its launch and step N-1's end, and ends `step_ms` later. Its gap is the device's idle time
in between, measured as worker_svc.step_clock measures a GPU's: 0 when launched ahead, and 0
after more than IDLE_GAP_S (an idle server, not a scheduling gap).

`NullLaunchedStep.ready()` is what the worker's step loop (worker_svc.step_loop) polls
before it finishes a step it launched ahead; `NullRunner.finish` sleeps until `done_at`.
"""

import time
from dataclasses import dataclass

from services.wire import IDLE_GAP_S
from worker_svc.launched_step import LaunchedStep


@dataclass(slots=True)
class NullLaunchedStep(LaunchedStep):
    """A launched step whose device work ends at `done_at` (perf_counter seconds)."""

    done_at: float = 0.0     # 0: no device work (a step that computes nothing)

    def ready(self) -> bool:
        return time.perf_counter() >= self.done_at


class EmulatedDevice:
    """When the emulated device is free again: the end of the last step queued on it."""

    __slots__ = ("_free_at",)

    def __init__(self) -> None:
        self._free_at: float | None = None    # None: no step before (the gap is not measured)

    def reset(self) -> None:
        """No step before: the next step's gap is not measured (a new input batch)."""
        self._free_at = None

    def queue(self, queued_at: float, busy_s: float) -> tuple[float, float]:
        """A step's work, queued at `queued_at` and taking `busy_s` seconds: (its end, the
        device's idle milliseconds before it started)."""
        previous = self._free_at
        start = queued_at if previous is None else max(queued_at, previous)
        gap_ms = 0.0
        if previous is not None and start - previous <= IDLE_GAP_S:
            gap_ms = (start - previous) * 1e3
        self._free_at = start + busy_s
        return self._free_at, gap_ms
