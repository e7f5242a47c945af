"""The bad-input table, at the validation layer (the gRPC status is checked end to end)."""

import pytest

from scheduler_svc.validation import (
    InvalidRequest,
    Limits,
    RawSampling,
    validate_model,
    validate_prompt,
    validate_sampling,
)

LIMITS = Limits(model_name="m", vocab_size=100, max_model_len=50)


@pytest.mark.parametrize("raw, match", [
    (RawSampling(max_tokens=0), "max_tokens must be >= 1"),
    (RawSampling(max_tokens=-3), "max_tokens must be >= 1"),
    (RawSampling(max_tokens=41), "exceeds the model's context"),
    (RawSampling(temperature=-0.1), "temperature must be >= 0"),
    (RawSampling(temperature=float("nan")), "temperature"),
    (RawSampling(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (RawSampling(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (RawSampling(top_k=-2), "top_k must be"),
    (RawSampling(min_tokens=5, max_tokens=2), "min_tokens"),
    (RawSampling(stop=("",)), "stop strings must not be empty"),
    (RawSampling(stop_token_ids=(100,)), "stop token id 100"),
    (RawSampling(logprobs=21), "logprobs"),
])
def test_bad_sampling(raw: RawSampling, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        validate_sampling(raw, 10, LIMITS)


def test_defaults_and_context_cap() -> None:
    params = validate_sampling(RawSampling(), 45, LIMITS)
    assert params.max_tokens == 5 and params.temperature == 1.0 and params.top_k == -1
    assert params.skip_special_tokens


@pytest.mark.parametrize("ids, match", [
    ([], "prompt is empty"),
    ([1, 100], "token id 100 is outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    (list(range(50)), "context is 50 tokens"),
])
def test_bad_prompt(ids: list[int], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        validate_prompt(ids, LIMITS)


def test_unknown_model() -> None:
    validate_model("", LIMITS)
    validate_model("m", LIMITS)
    with pytest.raises(InvalidRequest, match="unknown model 'x'"):
        validate_model("x", LIMITS)


def test_kv_capacity() -> None:
    limits = Limits("m", 100, 50, max_kv_tokens=16)
    with pytest.raises(InvalidRequest, match="more KV cache than a replica has"):
        validate_sampling(RawSampling(max_tokens=10), 10, limits)


def test_random_requests_always_carry_a_seed() -> None:
    """TP ranks sample independently from the same logits: without a client seed the
    scheduler picks one, so every rank draws the same token."""
    a = validate_sampling(RawSampling(temperature=0.8), 10, LIMITS)
    b = validate_sampling(RawSampling(temperature=0.8), 10, LIMITS)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert validate_sampling(RawSampling(temperature=0.8, seed=7), 10, LIMITS).seed == 7
    assert validate_sampling(RawSampling(temperature=0.0), 10, LIMITS).seed is None
