"""Sampling a step that is not plain greedy without reading the device (issue 37): on a GPU,
`sample_on_device` runs under torch's sync debug mode set to raise, for every kind of
request at once (seeded and unseeded, top-k, top-p, min-p, penalties over a history, logit
bias, logprobs, greedy rows among them); its tokens and logprobs are `sample`'s (what the CPU
path returns). So is a step's min_tokens mask (worker_svc.min_tokens). The CPU run checks the
test itself; scripts/gpu-check runs the CUDA one."""

import pytest
import torch

from services.wire import SamplingSpec
from worker_svc.input_batch import RequestState, ScheduledRequest
from worker_svc.min_tokens import banned_entries
from worker_svc.penalties import TokenHistory
from worker_svc.pending_tokens import PENDING
from worker_svc.sampler import new_generator, sample, sample_on_device

VOCAB = 3000


def spec(temperature: float, top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
         num_logprobs: int | None = None, **kw: object) -> SamplingSpec:
    return SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        num_logprobs=num_logprobs, **kw)  # type: ignore[arg-type]


SPECS = [
    spec(0.0),
    spec(0.8, seed=1),
    spec(1.0, seed=2, top_k=20),
    spec(0.9, seed=3, top_p=0.8),
    spec(1.1, seed=4, min_p=0.05, top_k=200, top_p=0.95),
    spec(0.7, seed=5, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
    spec(0.0, logit_bias=[(7, 5.0), (9, -3.0)]),
    spec(0.6, seed=6, num_logprobs=3),
    spec(0.0, num_logprobs=0),
    spec(1.0),                                   # unseeded: only its shape is compared
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sampling_a_mixed_step_reads_nothing_back(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (scripts/gpu-check runs it)")
    torch.manual_seed(0)
    logits = torch.randn(len(SPECS), VOCAB) * 4
    histories = [TokenHistory(list(range(10 + i, 60 + i)), 40) for i in range(len(SPECS))]
    expected, expected_logprobs = sample(logits, SPECS,
                                         [new_generator(s.seed) if s.seed is not None else None
                                          for s in SPECS], histories=histories)
    on = torch.device(device)
    logits_on = logits.to(on)
    generators = [new_generator(s.seed) if s.seed is not None else None for s in SPECS]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids, logprobs = sample_on_device(logits_on, SPECS, generators, histories)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert token_ids.device.type == on.type and logprobs is not None
    got = token_ids.tolist()
    # Every row but the unseeded one is determined by its logits and seed; a GPU's float
    # sums may move a draw across a boundary only where two tokens are all but tied.
    assert got[:-1] == expected[:-1]
    assert 0 <= got[-1] < VOCAB
    got_logprobs = logprobs.lists()
    assert [lp is None for lp in got_logprobs] == [lp is None for lp in expected_logprobs]
    for a, b in zip(got_logprobs, expected_logprobs, strict=True):
        if a is not None and b is not None:
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_banned_entries_mask_on_the_device_without_reading_it(device: str) -> None:
    """The sampler path of a step with min_tokens rows, under torch's sync debug mode set to
    raise on a GPU: the banned ids are never drawn, the logprobs are the raw logits'."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (scripts/gpu-check runs it)")
    on = torch.device(device)
    specs = [spec(0.0, min_tokens=5, min_tokens_ids=[3, 4]),
             spec(1.0, seed=1, num_logprobs=0, min_tokens=5, min_tokens_ids=[3]),
             spec(0.0, min_tokens=1, min_tokens_ids=[3, 4])]   # has its one output already
    states = [RequestState(f"r{i}", [9, 9, PENDING] if i == 2 else [9, 9], 2, [[1]], 2, s,
                           None) for i, s in enumerate(specs)]
    sampling = [ScheduledRequest(state, 1, 1, True) for state in states]
    logits = torch.zeros(3, 50)
    logits[:, 3] = 100.0
    logits[:, 4] = 50.0
    logits_on = logits.to(on)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        banned = banned_entries(sampling, on)
        assert banned is not None
        token_ids, logprobs = sample_on_device(logits_on, specs, [None, new_generator(1), None],
                                               banned=banned)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    got = token_ids.tolist()
    assert got[0] not in (3, 4) and got[1] == 4 and got[2] == 3
    assert logprobs is not None
    assert logprobs.lists()[1].logprob == pytest.approx(  # type: ignore[union-attr]
        float(logits[1].log_softmax(-1)[4]), abs=1e-4)
