"""Logit adjustments that depend on a request's token history or its own table: `logit_bias`,
the repetition, frequency and presence penalties, and `min_p`. Called by worker_svc.sampler
on the rows whose `SamplingSpec` asks for any of them; a batch where none does never comes
here (greedy-without-penalties stays on the device fast path).

What each does, as vLLM defines it:
- logit_bias: the given value is added to the token's logit.
- repetition_penalty r (HF / CTRL style, 1 = off): every token seen in the prompt or the
  output so far has its logit divided by r when positive, multiplied by r otherwise.
- frequency_penalty f, presence_penalty p (OpenAI style, 0 = off), over output tokens only:
  logit -= f * (times the token was generated) + p * (1 if it was generated at all).
- min_p m: after the temperature, tokens whose probability is below m times the most likely
  token's probability are dropped.
All are computed for the whole batch at once: a [rows, vocab] count of each row's tokens
from one padded tensor of its history, never a Python loop per token.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from services.wire import SamplingSpec


class TokenHistory(NamedTuple):
    """A request's known tokens (prompt, then outputs) and how many of them are the prompt."""

    token_ids: Sequence[int]
    num_prompt_tokens: int


def has_penalties(spec: SamplingSpec) -> bool:
    return (spec.repetition_penalty != 1.0 or spec.frequency_penalty != 0.0
            or spec.presence_penalty != 0.0)


def adjusts_logits(spec: SamplingSpec) -> bool:
    """The request needs its logits changed before sampling (min_p only matters off greedy,
    but is cheap to test here)."""
    return has_penalties(spec) or bool(spec.logit_bias)


def adjust_logits(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                  histories: Sequence[TokenHistory]) -> torch.Tensor:
    """logits: [rows, vocab] float32, one row per spec (every one `adjusts_logits`). Returns
    the adjusted logits (a new tensor): logit bias first, then the penalties."""
    rows, vocab = logits.shape
    device = logits.device
    out = logits.clone()
    biased = [(i, spec.logit_bias) for i, spec in enumerate(specs) if spec.logit_bias]
    if biased:
        row_index = [i for i, bias in biased for _ in bias]
        token_index = [t for _, bias in biased for t, _ in bias]
        values = [v for _, bias in biased for _, v in bias]
        out.index_put_((_on(row_index, torch.int64, device), _on(token_index, torch.int64, device)),
                       _on(values, out.dtype, device), accumulate=True)
    repeats = any(spec.repetition_penalty != 1.0 for spec in specs)
    counts_outputs = any(spec.frequency_penalty or spec.presence_penalty for spec in specs)
    if not (repeats or counts_outputs):
        return out
    output_counts = _token_counts([h.token_ids[h.num_prompt_tokens:] for h in histories],
                                  vocab, device)                       # [rows, vocab]
    if repeats:
        seen = _token_counts([h.token_ids[:h.num_prompt_tokens] for h in histories],
                             vocab, device) > 0                        # [rows, vocab]
        seen |= output_counts > 0
        repetition = _column([s.repetition_penalty for s in specs], device)   # [rows, 1]
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if counts_outputs:
        frequency = _column([s.frequency_penalty for s in specs], device)
        presence = _column([s.presence_penalty for s in specs], device)
        out -= frequency * output_counts + presence * (output_counts > 0).float()
    return out


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """probs: [rows, vocab] (after temperature and top-k); min_ps: [rows]. Zeroes every token
    below min_p times its row's best probability (the best one always stays) and renormalizes,
    so that top-p then measures its nucleus within what is left, as vLLM's order has it
    (min_p and top-k commute: both keep the best token and ratios to it)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]    # [rows, 1]
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _on(values: list[int] | list[float], dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
    """A host list on `device`, queued behind the device's work (not waiting for it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _on(values, torch.float32, device)[:, None]


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how many times each token id occurs in each row's list. The
    lists are padded with `vocab` into one tensor, counted by one scatter_add into a spare
    column, which is dropped."""
    rows = len(token_lists)
    longest = max((len(ids) for ids in token_lists), default=0)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=device)
    if longest == 0:
        return counts[:, :vocab]
    padded = torch.full((rows, longest), vocab, dtype=torch.int64)
    for i, ids in enumerate(token_lists):      # one slice copy per row, not per token
        if ids:
            padded[i, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.int64)
    padded = padded.to(device, non_blocking=True)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]
