"""One step's timings, from its launch to the `StepTimings` its output reports.

`StepTimer` is a runner's clock across steps: `ModelRunner.launch` (worker_svc.runner) calls
it around each step's forward, and `reset` when its input batch is dropped. It fills the
step's `StepClock` (the host's time in each phase of the launch, and on a CPU the idle gap
since the step before's forward) and, on a GPU, its `GpuSpan` (events around the queued work).
`step_timings`, called by worker_svc.step_output at finish, reads both: on a GPU the host only
queued the work, so the forward's time and the gap are the GPU's own clock.
"""

import time

import torch

from services.wire import IDLE_GAP_S, StepTimings


class StepClock:
    """The host's clock over one launch, in milliseconds."""

    __slots__ = ("num_tokens", "prepare_ms", "forward_ms", "sample_ms", "gap_ms")

    def __init__(self) -> None:
        self.num_tokens = 0        # tokens the forward ran
        self.prepare_ms = 0.0      # the diff applied, the step's tensors built
        self.forward_ms = 0.0      # the stage's layers (on a GPU: only queued)
        self.sample_ms = 0.0       # logits, sampling, KV copied out for the store
        self.gap_ms = 0.0          # idle since the step before's forward (CPU)


class GpuSpan:
    """CUDA events around one step's queued work: the GPU's clock, read at finish."""

    __slots__ = ("start", "end", "previous_end")

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.end: torch.cuda.Event | None = None           # after the step's last work
        self.previous_end: torch.cuda.Event | None = None  # the step before's `end`


class StepTimer:
    """The clock across one runner's steps: each launch's phases and the gap between them."""

    __slots__ = ("on_gpu", "_last_end")

    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        # The step before's end: its GpuSpan (GPU), or perf_counter() after its launch (CPU).
        self._last_end: GpuSpan | float | None = None

    def reset(self) -> None:
        """No step before: the next step's gap is not measured."""
        self._last_end = None

    def forward_starts(self, clock: StepClock, start: float, prepared: float) -> GpuSpan | None:
        """The step's forward begins (launch began at `start`, its tensors were ready at
        `prepared`): on a GPU, its span starts; on a CPU, the gap since the step before's
        forward is measured unless that was an idle pause."""
        if self.on_gpu:
            return GpuSpan()
        if isinstance(self._last_end, float) and start - self._last_end < IDLE_GAP_S:
            clock.gap_ms = (prepared - self._last_end) * 1e3
        return None

    def launched(self, clock: StepClock, gpu: GpuSpan | None, start: float, prepared: float,
                 forwarded: float) -> None:
        """The step's work is all queued (its forward returned at `forwarded`): close its
        span, fill its phases, and remember where it ended for the next step's gap."""
        if gpu is not None:
            gpu.end = torch.cuda.Event(enable_timing=True)
            gpu.end.record()
            if isinstance(self._last_end, GpuSpan):
                gpu.previous_end = self._last_end.end   # the gap is read at finish
        done = time.perf_counter()
        clock.prepare_ms = (prepared - start) * 1e3
        clock.forward_ms = (forwarded - prepared) * 1e3
        clock.sample_ms = (done - forwarded) * 1e3
        self._last_end = gpu if self.on_gpu else done


def step_timings(clock: StepClock, gpu: GpuSpan | None) -> StepTimings:
    """A finished step's timings (waits for its GPU span to end)."""
    forward_ms, sample_ms, gap_ms = clock.forward_ms, clock.sample_ms, clock.gap_ms
    if gpu is not None and gpu.end is not None:
        gpu.end.synchronize()
        forward_ms, sample_ms = gpu.start.elapsed_time(gpu.end), 0.0
        previous = gpu.previous_end
        gap_ms = 0.0 if previous is None else max(0.0, previous.elapsed_time(gpu.start))
        if gap_ms > IDLE_GAP_S * 1e3:
            gap_ms = 0.0
    return StepTimings(prepare_ms=clock.prepare_ms, forward_ms=forward_ms,
                       sample_ms=sample_ms, num_tokens=clock.num_tokens, gap_ms=gap_ms)
