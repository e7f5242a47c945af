"""The last pipeline stage's end of a step: sample the rows that sample, then build the
`StepOutput` the scheduler reads (tokens in step order, decode rows' tokens packed in their
order, logprobs, timings) or the one that reports a failed step.

Called by `ModelRunner` (worker_svc.runner): `sample_step` at launch, after the forward;
`step_output` at finish; `failed_output` for the server's answer to a step that raised.
Sampled tokens stay on the device (worker_svc.pending_tokens), greedy or not, and so do
logprobs until the step finishes: launch never waits for the forward it queued, except where
a request's penalties need the token of the step before, still on the device. The
timings come from worker_svc.step_clock.
"""

import numpy as np
import torch

from services.wire import StepError, StepInput, StepOutput, StepTimings, TokenLogprobs
from worker_svc.input_batch import ScheduledRequest
from worker_svc.launched_step import LaunchedStep, SampledTokens
from worker_svc.min_tokens import ban, banned_entries
from worker_svc.model.llama import LlamaModel
from worker_svc.penalties import TokenHistory, has_penalties
from worker_svc.pending_tokens import PendingTokens
from worker_svc.prompt_logprobs import prompt_logprobs
from worker_svc.sampler import sample_on_device
from worker_svc.step_clock import step_timings
from worker_svc.token_mask import apply_token_masks


def sample_step(model: LlamaModel, launched: LaunchedStep, layout: list[ScheduledRequest],
                hidden: torch.Tensor, residual: torch.Tensor, pending: PendingTokens,
                device: torch.device) -> None:
    """Logits for the rows that sample, then greedy on the device (tokens stay there,
    copied back asynchronously) or the full sampler (on the host's terms); fills
    `launched.tokens` (left None when no row samples)."""
    launched.prompt_logprobs = prompt_logprobs(model, layout, hidden, residual, device)
    rows, sampling = [], []
    end = 0
    for s in layout:
        end += s.num_new_tokens
        if s.samples:
            rows.append(end - 1)      # the request's last row in the flat batch
            sampling.append(s)
    if not sampling:
        return
    launched.tokens = sampled = SampledTokens(sampling)
    index = torch.tensor(rows).to(device, non_blocking=True)
    logits = model.compute_logits(hidden.index_select(0, index),
                                  residual.index_select(0, index))  # [rows, vocab]
    if launched.step.token_masks:    # structured output (worker_svc.token_mask)
        apply_token_masks(logits, launched.step.token_masks,
                          [s.state.request_id for s in sampling])
    banned = banned_entries(sampling, device)    # min_tokens (worker_svc.min_tokens)
    if all(s.state.plain_greedy for s in sampling):
        if banned is not None:
            ban(logits, banned, in_place=True)
        pending.hold(sampled, model.elementwise.argmax(logits), device)  # [rows] int64
        return
    # Penalties count the request's earlier tokens: one still on the device (the step
    # before, launched ahead) is waited for. Nothing else here reads the device.
    if any(has_penalties(s.state.sampling) and pending.holds(s.state.request_id)
           for s in sampling):
        pending.resolve_latest()
    token_ids, logprobs = sample_on_device(
        logits, [s.state.sampling for s in sampling], [s.state.generator for s in sampling],
        histories=[TokenHistory(s.state.token_ids, s.state.num_prompt_tokens)
                   for s in sampling], banned=banned)
    pending.hold(sampled, token_ids, device)
    sampled.device_logprobs = logprobs


def step_output(launched: LaunchedStep, worker_id: str, pending: PendingTokens) -> StepOutput:
    """Wait for `launched`'s tokens and timings; its `StepOutput`: the requests that sampled
    in step order, then the decode rows' tokens packed in their order."""
    decodes = launched.step.decodes
    row_tokens = None
    if decodes is not None:      # a row the batch skipped (dropped by a failed step) keeps -1
        row_tokens = np.full(len(decodes.slots) // 4, -1, dtype="<i4")
    by_request: dict[str, tuple[int, TokenLogprobs | None]] = {}
    sampled = launched.tokens
    if sampled is not None:
        token_ids = sampled.token_ids
        if token_ids is None:
            token_ids = pending.resolve(sampled)
        if sampled.device_logprobs is not None:
            sampled.logprobs = sampled.device_logprobs.lists()
        sampling = sampled.sampling
        if row_tokens is not None:
            rows = np.fromiter((s.decode_row for s in sampling), np.int64, len(sampling))
            is_row = rows >= 0
            row_tokens[rows[is_row]] = np.asarray(token_ids, dtype=np.int64)[is_row]
        by_request = {s.state.request_id: (t, lp) for s, t, lp in
                      zip(sampling, token_ids, sampled.logprobs, strict=True)
                      if s.decode_row < 0}
    ordered = [s.state.request_id for s in launched.scheduled
               if s.samples and s.decode_row < 0]
    return StepOutput(
        step_id=launched.step.step_id, worker_id=worker_id, request_ids=ordered,
        sampled_token_ids=[by_request[r][0] for r in ordered],
        logprobs=[by_request[r][1] for r in ordered],
        timings=step_timings(launched.clock, launched.gpu),
        prompt_logprobs=launched.prompt_logprobs,
        decode_token_ids=b"" if row_tokens is None else row_tokens.tobytes())


def failed_output(step: StepInput, exc: Exception, worker_id: str,
                  kv_written: bool) -> StepOutput:
    """The answer to `step` after its launch or finish raised `exc` (one-rank replicas).
    `kv_written`: the step's forward ran, so its KV slots hold new values."""
    return StepOutput(step_id=step.step_id, worker_id=worker_id, request_ids=[],
                      sampled_token_ids=[], logprobs=[],
                      timings=StepTimings(prepare_ms=0.0, forward_ms=0.0, sample_ms=0.0,
                                          num_tokens=0),
                      error=StepError(f"{type(exc).__name__}: {exc}"[:4096],
                                      kv_written=kv_written))
