"""The step types that pass between a worker's launch and finish of one step.

`ModelRunner.launch` (worker_svc.runner) makes a `LaunchedStep`; `ModelRunner.finish` turns it
into the stage's result; worker_svc.stage_step moves `StageActivations` between pipeline
stages. Each part of a launched step is filled by one owner, in the step's order:

- `activations`: a non-last stage's output (the runner);
- `tokens` (`SampledTokens`): the last stage's sampled rows and their tokens
  (worker_svc.step_output's `sample_step`; worker_svc.pending_tokens for tokens still on the
  device);
- `clock` and `gpu`: its timings (worker_svc.step_clock);
- `saves` and `loads`: the KV store traffic it started (worker_svc.kv_saver, kv_loader).

Plain data: no method here touches a tensor's values.
"""

from dataclasses import dataclass, field

import torch

from services.wire import PromptLogprobs, StepInput, TokenLogprobs
from worker_svc.input_batch import ScheduledRequest
from worker_svc.kv_saver import PendingSave
from worker_svc.load_ticket import LoadTicket
from worker_svc.sampler import DeviceLogprobs
from worker_svc.step_clock import GpuSpan, StepClock


@dataclass(slots=True)
class StageActivations:
    """What a non-last pipeline stage hands to the next one, rows in the step's layout."""

    hidden_states: torch.Tensor   # [num_tokens, hidden_size]
    residual: torch.Tensor        # [num_tokens, hidden_size]


@dataclass(slots=True)
class SampledTokens:
    """The rows of a step that sample (in the step's layout) and their tokens: on the host
    (`token_ids`, sampled there), or still on the device (a greedy step: `device_tokens`, with
    their copy to `host_tokens` complete at `copied`; see worker_svc.pending_tokens)."""

    sampling: list[ScheduledRequest]                    # the rows that sample, in order
    token_ids: list[int] | None = None                  # None: read from the device at finish
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    device_tokens: torch.Tensor | None = None           # [len(sampling)] int64, greedy steps
    host_tokens: torch.Tensor | None = None             # their copy on the host
    copied: torch.cuda.Event | None = None              # host_tokens complete
    positions: list[int] = field(default_factory=list)  # each row's PENDING index
    device_logprobs: DeviceLogprobs | None = None       # read into `logprobs` at finish

    def ready(self) -> bool:
        """Whether the tokens can be read without waiting for the device."""
        return self.copied is None or self.copied.query()


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued; `ModelRunner.finish` turns it into its result."""

    step: StepInput
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    activations: StageActivations | None = None         # non-last stages
    tokens: SampledTokens | None = None                 # last stage; None: no row samples
    clock: StepClock = field(default_factory=StepClock)
    gpu: GpuSpan | None = None                          # CUDA only
    saves: list[PendingSave] = field(default_factory=list)  # KV chunks copied out, to queue
    loads: LoadTicket | None = None                     # KV store loads it started
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # last stage

    def ready(self) -> bool:
        """Whether `finish` would return without waiting for the device."""
        return self.tokens is None or self.tokens.ready()
