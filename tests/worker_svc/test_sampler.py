"""Sampler: greedy, top-k/top-p limits, seeded reproducibility, logprobs."""

import math

import pytest
import torch

from services.wire import SamplingSpec
from worker_svc.sampler import new_generator, sample

VOCAB = 1000


def spec(temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
         num_logprobs: int | None = None) -> SamplingSpec:
    return SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                        num_logprobs=num_logprobs)


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = random_logits(4)
    logits[2, 10] = logits[2, 700] = logits[2].max() + 1
    tokens, logprobs = sample(logits, [spec(temperature=0.0)] * 4, [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[2] == 10
    assert logprobs == [None] * 4


def test_an_all_greedy_batch_uses_the_given_argmax() -> None:
    logits = random_logits(3).to(torch.bfloat16)
    seen: list[torch.Tensor] = []

    def argmax(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x.float().argmax(dim=-1)

    tokens, _ = sample(logits, [spec(temperature=0.0)] * 3, [None] * 3, argmax=argmax)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert len(seen) == 1 and seen[0].dtype == torch.bfloat16   # not widened first
    # Logprobs or a random row take the float32 path.
    sample(logits, [spec(temperature=0.0, num_logprobs=1)] * 3, [None] * 3, argmax=argmax)
    sample(logits, [spec(temperature=0.0)] * 2 + [spec(seed=1)], [None] * 3, argmax=argmax)
    assert len(seen) == 1


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = random_logits(8, seed=1)
    greedy = logits.argmax(dim=-1).tolist()
    for _ in range(3):
        assert sample(logits, [spec(top_k=1)] * 8, [None] * 8)[0] == greedy
        assert sample(logits, [spec(top_p=1e-6)] * 8, [None] * 8)[0] == greedy
        assert sample(logits, [spec(temperature=1e-4)] * 8, [None] * 8)[0] == greedy


def test_mixed_greedy_and_random_rows() -> None:
    logits = random_logits(4, seed=2)
    specs = [spec(temperature=0.0), spec(top_k=1), spec(temperature=0.0), spec(top_p=1e-6)]
    assert sample(logits, specs, [None] * 4)[0] == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_never_leave_their_sets() -> None:
    logits = random_logits(1, seed=3)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = logits[0].softmax(dim=-1)
    ranked = probs.argsort(descending=True)
    mass_before = probs[ranked].cumsum(0) - probs[ranked]
    nucleus = set(ranked[mass_before < 0.5].tolist())
    gen = new_generator(7)
    for _ in range(200):
        assert sample(logits, [spec(top_k=5)], [gen])[0][0] in top5
        assert sample(logits, [spec(top_p=0.5)], [gen])[0][0] in nucleus


def test_wide_nucleus_falls_back_to_full_ranking() -> None:
    flat = torch.zeros(1, VOCAB)            # nucleus of 950 tokens, past the 256 candidates
    seen = {sample(flat, [spec(top_p=0.95)], [None])[0][0] for _ in range(300)}
    assert len(seen) > 100


def test_frequencies_follow_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = (logits[0] / 0.7).softmax(dim=-1)
    gen = new_generator(11)
    draws = [sample(logits, [spec(temperature=0.7)], [gen])[0][0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    logits = [random_logits(6, seed=100 + step) for step in range(10)]
    target = spec(temperature=0.9, top_p=0.95, top_k=50, seed=1234)

    alone_gen = new_generator(1234)
    alone = [sample(step_logits[3:4], [target], [alone_gen])[0][0] for step_logits in logits]

    gens = [new_generator(5), None, None, new_generator(1234), new_generator(9), None]
    specs = [spec(seed=5), spec(temperature=0.0), spec(top_p=0.3), target,
             spec(temperature=2.0, seed=9), spec()]
    batched = [sample(step_logits, specs, gens)[0][3] for step_logits in logits]
    assert batched == alone


def test_fast_forwarded_generator_continues_the_sequence() -> None:
    logits = random_logits(1, seed=4)
    target = spec(temperature=1.5, seed=77)
    gen = new_generator(77)
    uninterrupted = [sample(logits, [target], [gen])[0][0] for _ in range(8)]
    resumed_gen = new_generator(77, num_samples_done=5)
    resumed = [sample(logits, [target], [resumed_gen])[0][0] for _ in range(3)]
    assert resumed == uninterrupted[5:]


def test_logprobs_of_raw_logits() -> None:
    vocab = 16
    logits = random_logits(3, seed=5, vocab=vocab)
    specs = [spec(temperature=0.0, num_logprobs=vocab), spec(temperature=0.5, num_logprobs=0),
             spec(temperature=0.0)]
    tokens, logprobs = sample(logits, specs, [None] * 3)
    expected = logits.log_softmax(dim=-1)

    full = logprobs[0]
    assert full is not None
    assert math.isclose(sum(math.exp(lp) for lp in full.top_logprobs), 1.0, rel_tol=1e-5)
    assert full.top_logprobs == sorted(full.top_logprobs, reverse=True)
    assert full.top_token_ids[0] == tokens[0]
    assert math.isclose(full.logprob, expected[0, tokens[0]].item(), rel_tol=1e-6)

    sampled_only = logprobs[1]
    assert sampled_only is not None
    assert sampled_only.top_token_ids == [] and sampled_only.top_logprobs == []
    # Logprobs describe the raw distribution, not the temperature-scaled one.
    assert math.isclose(sampled_only.logprob, expected[1, tokens[1]].item(), rel_tol=1e-6)
    assert logprobs[2] is None


def test_bfloat16_logits_are_sampled_in_float32() -> None:
    logits = random_logits(2, seed=6)
    tokens, _ = sample(logits.bfloat16(), [spec(temperature=0.0)] * 2, [None] * 2)
    assert tokens == logits.bfloat16().float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-45, 1.2e-38, 1e-30, 9e-6])
def test_tiny_temperatures_are_greedy_never_nan(temperature: float) -> None:
    """logits / 1e-45 overflow to inf and softmax gives NaN: such rows must be greedy."""
    logits = random_logits(6, seed=8)
    greedy = logits.argmax(dim=-1).tolist()
    specs = [spec(temperature=temperature, seed=i) for i in range(6)]
    for _ in range(3):
        gens = [new_generator(i) for i in range(6)]
        assert sample(logits, specs, gens)[0] == greedy
    # Next to a random row, and with logprobs (the float32 path).
    mixed = [spec(temperature=temperature, num_logprobs=2), spec(seed=1)] * 3
    tokens, logprobs = sample(logits, mixed, [None, new_generator(1)] * 3)
    assert tokens[::2] == greedy[::2]
    assert all(lp is not None and math.isfinite(lp.logprob) for lp in logprobs[::2])


def test_rows_without_finite_mass_fall_back_to_argmax() -> None:
    logits = random_logits(2, seed=9)
    logits[0, 7] = float("inf")                 # softmax of this row is NaN
    tokens, _ = sample(logits, [spec(seed=1), spec(seed=2)], [new_generator(1), new_generator(2)])
    assert tokens[0] == 7
    assert 0 <= tokens[1] < VOCAB


def seeded_draws(seed: int, num: int = 48) -> list[int]:
    flat = torch.zeros(1, VOCAB)               # every token equally likely: tokens = uniforms
    gen = new_generator(seed)
    return [sample(flat, [spec(seed=seed)], [gen])[0][0] for _ in range(num)]


def test_every_seed_bit_counts() -> None:
    """torch's CPU generator keeps only a seed's low 32 bits: 5, 2**32 + 5 and 2**63 + 5 drew
    the same tokens. All 64 bits must give different, reproducible streams."""
    seeds = [5, 2**32 + 5, 2**63, 2**63 + 5, 2**64 - 1, 2**64 - 2, 0]
    streams = [seeded_draws(s) for s in seeds]
    assert len({tuple(s) for s in streams}) == len(seeds)
    assert streams == [seeded_draws(s) for s in seeds]


def test_seed_must_be_a_uint64() -> None:
    with pytest.raises(ValueError, match="uint64"):
        new_generator(2**64)
    with pytest.raises(ValueError, match="uint64"):
        new_generator(-1)
