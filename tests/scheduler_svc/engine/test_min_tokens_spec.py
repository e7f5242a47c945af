"""What the engine core tells the workers about min_tokens (scheduler_svc.engine.granted,
`SamplingParams.to_spec`): the count and the ids the sampler masks until then, the model's EOS
ids and the request's stop token ids, EOS even under ignore_eos (vLLM's masking)."""

import pytest

from scheduler_svc.engine.granted import apply_admission
from scheduler_svc.engine.request import Request, SamplingParams
from services.kv_wire import AdmitResult

EOS = (2, 0)


def admitted(sampling: SamplingParams) -> Request:
    return Request("r", [5, 6, 7], sampling, EOS, max_model_len=64, block_size=4,
                   hash_blocks=False)


@pytest.mark.parametrize(("min_tokens", "stop_ids", "ignore_eos", "masked"), [
    (3, (9, 2), False, [0, 2, 9]),
    (3, (9,), True, [0, 2, 9]),         # ignore_eos: EOS ends nothing, but is still held back
    (0, (9,), False, []),               # no min_tokens: nothing to mask, nothing sent
])
def test_the_new_request_carries_min_tokens_and_the_ids_it_masks(
        min_tokens: int, stop_ids: tuple[int, ...], ignore_eos: bool, masked: list[int]) -> None:
    request = admitted(SamplingParams(min_tokens=min_tokens, stop_token_ids=stop_ids,
                                      ignore_eos=ignore_eos))
    new = apply_admission(request, AdmitResult("r", 0, 3, [[1]], 0))
    assert new.sampling.min_tokens == (min_tokens if masked else 0)
    assert new.sampling.min_tokens_ids == masked


def test_the_front_ends_spec_leaves_min_tokens_to_the_engine() -> None:
    spec = SamplingParams(min_tokens=3, stop_token_ids=(9,)).to_spec()
    assert (spec.min_tokens, spec.min_tokens_ids) == (0, [])
