"""min_tokens on the worker: while a request has fewer outputs than its `SamplingSpec.
min_tokens`, the ids of its `min_tokens_ids` (the model's EOS ids and its stop token ids, as
the scheduler sends them) cannot be sampled: their logits are -inf, greedy included. This is
vLLM's meaning (its sampler masks them); the engine core's stop check alone would let a
request sample EOS early and then keep generating after it.

Called by worker_svc.step_output's `sample_step` on the rows that sample. The rows to mask
are found on the host from what the worker already knows (the request's token count counts
the placeholders of tokens still on the device), and the index lists travel to the device
without a blocking copy: nothing is read back, so launch-ahead holds. Logprobs stay those of
the raw logits (vLLM's default): the sampler takes them before it applies the mask.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:       # worker_svc.input_batch imports the sampler, which imports this
    from worker_svc.input_batch import ScheduledRequest

# (rows, token ids): the logits entries a step sets to -inf, as two int64 device tensors.
Banned = tuple[torch.Tensor, torch.Tensor]


def banned_entries(sampling: Sequence["ScheduledRequest"], device: torch.device
                   ) -> Banned | None:
    """The entries of the sampled rows' logits ([len(sampling), vocab]) that min_tokens
    masks this step; None when no row is short of its min_tokens (most steps: one integer
    test per row)."""
    rows: list[int] = []
    token_ids: list[int] = []
    for i, s in enumerate(sampling):
        spec = s.state.sampling
        if spec.min_tokens and (len(s.state.token_ids) - s.state.num_prompt_tokens
                                < spec.min_tokens):
            rows += [i] * len(spec.min_tokens_ids)
            token_ids += spec.min_tokens_ids
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True))


def ban(logits: torch.Tensor, banned: Banned, in_place: bool = False) -> torch.Tensor:
    """`logits` with the `banned` entries at -inf (a new tensor unless `in_place`). The
    value is filled on the device: no host scalar is copied over."""
    value = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    if in_place:
        return logits.index_put_(banned, value)
    return logits.index_put(banned, value)
