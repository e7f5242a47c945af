"""Prompt logprobs (SamplingSpec.num_prompt_logprobs): for every prompt position a step
computes, the logprob of the prompt token that follows it, its rank and the top alternatives,
from the model's raw distribution. Called by worker_svc.step_output on the last stage, for
the step's requests that asked, non-final prefill chunks included.

The row at position p predicts the token at p + 1, so a step computing positions [c, c + n)
of a prompt of P tokens yields entries for positions c + 1 .. min(c + n, P - 1). Logits are
made a slice of rows at a time: a long prefill chunk's [rows, vocab] at once would be large.
"""

import torch

from services.wire import PromptLogprobs, TokenLogprobs
from worker_svc.input_batch import ScheduledRequest
from worker_svc.model.llama import LlamaModel

ROWS_PER_SLICE = 256


def prompt_logprobs(model: LlamaModel, layout: list[ScheduledRequest], hidden: torch.Tensor,
                    residual: torch.Tensor, device: torch.device) -> list[PromptLogprobs]:
    """hidden, residual: [num_tokens, hidden_size], the step's rows in `layout` order."""
    results = []
    row = 0
    for s in layout:
        num_top = s.state.sampling.num_prompt_logprobs
        c = s.num_computed_tokens
        end = min(c + s.num_new_tokens, s.state.num_prompt_tokens - 1)
        if num_top is not None and end > c:
            results.append(_one_request(model, s, hidden, residual, row, c, end, num_top,
                                        device))
        row += s.num_new_tokens
    return results


def _one_request(model: LlamaModel, s: ScheduledRequest, hidden: torch.Tensor,
                 residual: torch.Tensor, row: int, start: int, end: int, num_top: int,
                 device: torch.device) -> PromptLogprobs:
    """Positions [start, end) of one request, whose first row is `row`."""
    chosen: list[float] = []
    ranks: list[int] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    for first in range(start, end, ROWS_PER_SLICE):
        last = min(first + ROWS_PER_SLICE, end)
        index = torch.arange(row + first - start, row + last - start, device=device)
        logprobs = model.compute_logits(hidden.index_select(0, index),
                                        residual.index_select(0, index)
                                        ).float().log_softmax(dim=-1)   # [rows, vocab]
        targets = torch.tensor(s.state.token_ids[first + 1:last + 1], device=device)
        picked = logprobs.gather(1, targets[:, None])                   # [rows, 1]
        chosen += picked[:, 0].tolist()
        ranks += ((logprobs > picked).sum(dim=-1) + 1).tolist()
        if num_top:
            values, ids = logprobs.topk(num_top, dim=-1)
            top_values += values.tolist()
            top_ids += ids.tolist()
    entries = [TokenLogprobs(logprob=v, top_token_ids=top_ids[i] if num_top else [],
                             top_logprobs=top_values[i] if num_top else [])
               for i, v in enumerate(chosen)]
    return PromptLogprobs(s.state.request_id, start + 1, entries, ranks)
