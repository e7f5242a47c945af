"""The step types that pass between a worker's launch and finish of one step.

`ModelRunner.launch` (worker_svc.runner) fills a `LaunchedStep`; `ModelRunner.finish` turns it
into the stage's result; worker_svc.stage_step moves `StageActivations` between pipeline
stages; worker_svc.pending_tokens and worker_svc.step_output read and write the sampled
tokens it holds. Plain data: no method here touches a tensor's values.
"""

from dataclasses import dataclass, field

import torch

from services.wire import StepInput, TokenLogprobs
from worker_svc.input_batch import ScheduledRequest
from worker_svc.kv_loader import LoadTicket
from worker_svc.kv_saver import PendingSave


@dataclass(slots=True)
class StageActivations:
    """What a non-last pipeline stage hands to the next one, rows in the step's layout."""

    hidden_states: torch.Tensor   # [num_tokens, hidden_size]
    residual: torch.Tensor        # [num_tokens, hidden_size]


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued; `ModelRunner.finish` turns it into its result."""

    step: StepInput
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    sampling: list[ScheduledRequest] = field(default_factory=list)  # sampled rows, in order
    activations: StageActivations | None = None        # non-last stages
    device_tokens: torch.Tensor | None = None          # [len(sampling)] int64, greedy steps
    host_tokens: torch.Tensor | None = None            # their copy on the host
    token_ids: list[int] | None = None                 # already on the host (sampled there)
    positions: list[int] = field(default_factory=list)  # each sampling row's PENDING index
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    copied: torch.cuda.Event | None = None             # host_tokens complete
    gpu_start: torch.cuda.Event | None = None
    gpu_end: torch.cuda.Event | None = None
    previous_end: torch.cuda.Event | None = None       # the step before's gpu_end
    num_tokens: int = 0
    prepare_ms: float = 0.0
    forward_ms: float = 0.0                            # host time; GPU time when on CUDA
    sample_ms: float = 0.0
    launched_at: float = 0.0                           # perf_counter() after the launch
    gap_ms: float = 0.0
    saves: list[PendingSave] = field(default_factory=list)  # KV chunks copied out, to queue
    loads: LoadTicket | None = None                    # KV store loads it started

    def ready(self) -> bool:
        """Whether `finish` would return without waiting for the device."""
        return self.copied is None or self.copied.query()
