"""Structured output on the worker: the scheduler's token bitmasks (`StepInput.token_masks`,
one per constrained request that samples this step) applied to the last stage's logits before
any sampling, greedy included, so a request can only draw a token its grammar allows.

Called by worker_svc.step_output's `sample_step` once the sampled rows' logits exist. A step
with no masks costs one empty-list check. Masks are checked before they touch a logit: each
names a request that samples in this step, at most once, with exactly `mask_num_bytes(width)`
bytes for the logits' width; anything else raises ValueError and fails the step.

The scheduler's grammar state (scheduler_svc.engine.grammar) fills each mask from its
tokenizer's vocabulary; ids past it (a logits width padded beyond the tokenizer) are never
allowed.
"""

from collections.abc import Sequence

import numpy as np
import torch

from services.wire import TokenMask

BITS_PER_WORD = 32


def mask_num_bytes(vocab_size: int) -> int:
    """Bytes of one packed mask over `vocab_size` token ids: whole int32 words."""
    return -(-vocab_size // BITS_PER_WORD) * 4


def mask_rows(masks: Sequence[TokenMask], request_ids: Sequence[str],
              vocab_size: int) -> list[int]:
    """The row (index into `request_ids`, the step's sampled requests) of each mask; raises
    ValueError for a mask of the wrong length, for a request that does not sample in this
    step, or for a second mask of one request."""
    row_of = {request_id: i for i, request_id in enumerate(request_ids)}
    expected = mask_num_bytes(vocab_size)
    rows: list[int] = []
    seen: set[str] = set()
    for mask in masks:
        if len(mask.bitmask) != expected:
            raise ValueError(
                f"token mask of {mask.request_id!r} is {len(mask.bitmask)} bytes; the logits' "
                f"{vocab_size} ids need {expected} (ceil({vocab_size} / 32) int32 words)")
        if mask.request_id in seen:
            raise ValueError(f"two token masks for request {mask.request_id!r}")
        row = row_of.get(mask.request_id)
        if row is None:
            raise ValueError(f"token mask for request {mask.request_id!r}, which does not "
                             "sample in this step")
        seen.add(mask.request_id)
        rows.append(row)
    return rows


def unpack_masks(masks: Sequence[TokenMask], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """[len(masks), vocab_size] bool, True where a token is allowed. The packed words travel
    to the device (32 times smaller than the bools) and are unpacked there."""
    packed = np.frombuffer(b"".join(m.bitmask for m in masks), dtype="<i4")
    words = torch.from_numpy(packed.astype(np.int32)).to(device, non_blocking=True)
    words = words.view(len(masks), -1)                                   # [masks, words]
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1                            # [masks, words, 32]
    return bits.view(len(masks), -1)[:, :vocab_size].bool()


def apply_token_masks(logits: torch.Tensor, masks: Sequence[TokenMask],
                      request_ids: Sequence[str]) -> torch.Tensor:
    """logits: [rows, vocab], one row per entry of `request_ids`. Sets every disallowed
    token's logit of a masked row to -inf, in place; unmasked rows are left alone."""
    if not masks:
        return logits
    vocab_size = logits.shape[-1]
    rows = mask_rows(masks, request_ids, vocab_size)
    allowed = unpack_masks(masks, vocab_size, logits.device)          # [masks, vocab]
    index = torch.tensor(rows).to(logits.device, non_blocking=True)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)
    return logits
