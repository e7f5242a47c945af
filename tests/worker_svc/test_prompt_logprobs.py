"""Prompt logprobs on the last stage: positions a step computes (chunks included) against
log_softmax of the same logits, and the scheduler's gathering of them across chunks and
recomputes."""

import pytest
import torch

from scheduler_svc.engine.request import Request, SamplingParams
from services.wire import SamplingSpec, TokenLogprobs
from worker_svc import prompt_logprobs as module
from worker_svc.input_batch import RequestState, ScheduledRequest
from worker_svc.prompt_logprobs import prompt_logprobs

VOCAB = 30


class LinearHead:
    """compute_logits: a fixed linear map of hidden + residual (float32)."""

    def __init__(self) -> None:
        self.weight = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return (hidden + residual) @ self.weight


def scheduled(rid: str, token_ids: list[int], num_prompt: int, start: int, num_new: int,
              num_top: int | None) -> ScheduledRequest:
    spec = SamplingSpec(0.0, 1.0, -1, None, None, num_prompt_logprobs=num_top)
    state = RequestState(rid, token_ids, num_prompt, [[1]], start, spec, None)
    return ScheduledRequest(state, start, num_new, samples=start + num_new == len(token_ids))


@pytest.mark.parametrize("rows_per_slice", [2, 256])
def test_each_computed_prompt_position_scores_the_next_token(
        monkeypatch: pytest.MonkeyPatch, rows_per_slice: int) -> None:
    monkeypatch.setattr(module, "ROWS_PER_SLICE", rows_per_slice)
    model = LinearHead()
    ids_a = [3, 5, 7, 9, 11, 13]                     # 6 prompt tokens
    ids_b = [2, 4, 6]
    layout = [scheduled("a", ids_a, 6, 2, 3, 2),    # positions 2, 3, 4: tokens 3..5 scored
              scheduled("skip", [1, 1, 1], 3, 0, 3, None),
              scheduled("b", ids_b + [8], 3, 2, 2, 0)]   # decode row past the prompt: none
    hidden = torch.randn(8, 8)
    residual = torch.randn(8, 8)
    out = prompt_logprobs(model, layout, hidden, residual,  # type: ignore[arg-type]
                          torch.device("cpu"))
    assert [(o.request_id, o.first_position, len(o.logprobs)) for o in out] == [("a", 3, 3)]
    logprobs = model.compute_logits(hidden[:3], residual[:3]).log_softmax(dim=-1)
    for i, (lp, rank) in enumerate(zip(out[0].logprobs, out[0].ranks, strict=True)):
        target = ids_a[3 + i]
        assert lp.logprob == pytest.approx(logprobs[i, target].item(), abs=1e-6)
        assert rank == int((logprobs[i] > logprobs[i, target]).sum()) + 1
        values, top_ids = logprobs[i].topk(2)
        assert lp.top_token_ids == top_ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist())


def test_the_scheduler_gathers_chunks_once_and_hands_them_to_the_first_output() -> None:
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), (0,), 100, 4,
                      hash_blocks=False)
    lps = [TokenLogprobs(-float(i), [], []) for i in range(1, 5)]   # positions 1..4
    request.add_prompt_logprobs(1, lps[:2], [1, 2])       # first chunk: positions 1, 2
    request.add_prompt_logprobs(1, lps[:2], [1, 2])       # recomputed: nothing new
    request.add_prompt_logprobs(4, lps[3:], [4])          # a gap: refused
    request.add_prompt_logprobs(2, lps[1:], [2, 3, 4])    # overlaps by one
    assert request.prompt_logprobs_output() == [(6, lps[0], 1), (7, lps[1], 2),
                                                (8, lps[2], 3), (9, lps[3], 4)]
    request.add_prompt_logprobs(4, [lps[3], lps[3]], [1, 1])   # past the prompt: refused
    assert len(request.prompt_logprobs) == 4
    plain = Request("p", [5, 6], SamplingParams(), (0,), 100, 4, hash_blocks=False)
    assert plain.prompt_logprobs_output() is None
