"""Penalties, logit_bias and min_p: the batched sampler against a plain per-token reference
(vLLM's definitions written out loop by loop), and their path through `sample`."""

import math

import pytest
import torch

from services.wire import SamplingSpec
from worker_svc.penalties import TokenHistory, adjust_logits, apply_min_p
from worker_svc.sampler import is_plain_greedy, new_generator, sample

VOCAB = 50


def spec(temperature: float = 0.0, **kwargs: object) -> SamplingSpec:
    return SamplingSpec(temperature, 1.0, -1, kwargs.pop("seed", None),  # type: ignore[arg-type]
                        kwargs.pop("num_logprobs", None), **kwargs)  # type: ignore[arg-type]


def reference_adjust(logits: list[float], s: SamplingSpec, history: TokenHistory) -> list[float]:
    """One row, one token at a time."""
    out = list(logits)
    for token_id, bias in s.logit_bias:
        out[token_id] += bias
    prompt = list(history.token_ids[:history.num_prompt_tokens])
    output = list(history.token_ids[history.num_prompt_tokens:])
    for token_id in range(len(out)):
        if token_id in prompt or token_id in output:
            r = s.repetition_penalty
            out[token_id] = out[token_id] / r if out[token_id] > 0 else out[token_id] * r
        count = output.count(token_id)
        out[token_id] -= s.frequency_penalty * count
        if count:
            out[token_id] -= s.presence_penalty
    return out


def random_case(seed: int) -> tuple[torch.Tensor, list[SamplingSpec], list[TokenHistory]]:
    g = torch.Generator().manual_seed(seed)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    specs, histories = [], []
    for i in range(rows):
        num_prompt = int(torch.randint(1, 12, (1,), generator=g))
        num_output = int(torch.randint(0, 20, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (num_prompt + num_output,), generator=g).tolist()
        histories.append(TokenHistory(ids, num_prompt))
        bias = [(int(t), float(torch.randn(1, generator=g)) * 5)
                for t in torch.randperm(VOCAB, generator=g)[:i]]
        specs.append(spec(presence_penalty=[0.0, 1.5, -0.7][i % 3],
                          frequency_penalty=[0.3, 0.0, -1.1][i % 3],
                          repetition_penalty=[1.0, 1.3, 0.8, 2.0][i % 4], logit_bias=bias))
    return logits, specs, histories


@pytest.mark.parametrize("seed", range(5))
def test_batched_adjustment_matches_the_reference(seed: int) -> None:
    logits, specs, histories = random_case(seed)
    got = adjust_logits(logits, specs, histories)
    for i, (s, h) in enumerate(zip(specs, histories, strict=True)):
        want = reference_adjust(logits[i].tolist(), s, h)
        assert got[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5), f"row {i}"


def test_presence_and_frequency_count_outputs_only_repetition_counts_the_prompt() -> None:
    logits = torch.full((1, VOCAB), 2.0)
    history = TokenHistory([7, 7, 8, 9, 9, 9], 2)     # prompt 7 7; outputs 8 9 9 9
    out = adjust_logits(logits, [spec(frequency_penalty=0.5, presence_penalty=1.0)],
                        [history])[0]
    assert out[7].item() == 2.0                        # prompt only: not penalized
    assert out[8].item() == pytest.approx(2.0 - 0.5 - 1.0)
    assert out[9].item() == pytest.approx(2.0 - 1.5 - 1.0)
    out = adjust_logits(logits, [spec(repetition_penalty=2.0)], [history])[0]
    assert out[7].item() == out[8].item() == out[9].item() == 1.0
    assert out[10].item() == 2.0
    negative = torch.full((1, VOCAB), -2.0)
    assert adjust_logits(negative, [spec(repetition_penalty=2.0)], [history])[0, 7] == -4.0


def test_min_p_keeps_tokens_at_least_min_p_of_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.2, 0.2, 0.2, 0.2, 0.2]])
    kept = apply_min_p(probs, torch.tensor([0.2, 0.9]))
    assert kept[0].tolist() == pytest.approx([0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0.0, 0.0])
    assert kept[1].tolist() == pytest.approx([0.2] * 5)


def test_greedy_with_penalties_is_the_argmax_of_the_adjusted_logits() -> None:
    logits, specs, histories = random_case(7)
    tokens, logprobs = sample(logits, specs, [None] * len(specs), histories=histories)
    for i, (s, h) in enumerate(zip(specs, histories, strict=True)):
        adjusted = reference_adjust(logits[i].tolist(), s, h)
        assert tokens[i] == max(range(VOCAB), key=lambda t: (adjusted[t], -t))
    assert logprobs == [None] * len(specs)


def test_a_strong_penalty_changes_the_greedy_token_and_logprobs_stay_raw() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    logits[0, 4] = 4.0
    history = TokenHistory([1, 3], 1)                 # 3 was generated
    plain, _ = sample(logits, [spec()], [None])
    assert plain == [3]
    tokens, logprobs = sample(logits, [spec(presence_penalty=2.0, num_logprobs=1)], [None],
                              histories=[history])
    assert tokens == [4]
    raw = logits.log_softmax(dim=-1)[0]
    assert logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(raw[4].item())
    assert logprobs[0].top_token_ids == [3]           # the model's own best, not the penalized


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    specs = [spec(logit_bias=[(11, 100.0)]), spec(temperature=1.0, seed=5,
                                                  logit_bias=[(t, -100.0) for t in range(VOCAB)
                                                              if t != 17])]
    histories = [TokenHistory([0], 1)] * 2
    for _ in range(3):
        tokens, _ = sample(logits, specs, [None, new_generator(5)], histories=histories)
        assert tokens == [11, 17]


def test_min_p_sampling_draws_only_tokens_above_the_cut() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05] + [1e-9] * (VOCAB - 5)]))
    s = spec(temperature=1.0, seed=9, min_p=0.4)        # cut at 0.16: tokens 0, 1, 2 remain
    generator = new_generator(9)
    drawn = {sample(logits, [s], [generator], histories=[TokenHistory([0], 1)])[0][0]
             for _ in range(200)}
    assert drawn == {0, 1, 2}


def test_seeded_draw_matches_inverse_cdf_over_the_reference_distribution() -> None:
    """temperature + penalties + min_p: the same uniform picks the same token as a reference
    inverse CDF over the reference's probabilities."""
    logits, specs, histories = random_case(11)
    specs = [SamplingSpec(0.8, 1.0, -1, 100 + i, None, min_p=0.05,
                          presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias)
             for i, s in enumerate(specs)]
    tokens, _ = sample(logits, specs, [new_generator(s.seed or 0) for s in specs],
                       histories=histories)
    for i, (s, h) in enumerate(zip(specs, histories, strict=True)):
        adjusted = reference_adjust(logits[i].tolist(), s, h)
        best = max(adjusted)
        weights = [math.exp((x - best) / s.temperature) for x in adjusted]
        top = max(weights)
        weights = [w if w >= s.min_p * top else 0.0 for w in weights]
        target = new_generator(s.seed or 0).next() * sum(weights)
        running, want = 0.0, VOCAB - 1
        for t, w in enumerate(weights):
            running += w
            if running > target:
                want = t
                break
        assert tokens[i] == want, f"row {i}"


def test_only_plain_greedy_stays_on_the_fast_path() -> None:
    assert is_plain_greedy(spec())
    assert not is_plain_greedy(spec(repetition_penalty=1.2))
    assert not is_plain_greedy(spec(logit_bias=[(1, 1.0)]))
    assert is_plain_greedy(spec(min_p=0.5))             # greedy ignores min_p
    seen: list[torch.Tensor] = []

    def argmax(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x.argmax(dim=-1)

    logits = torch.randn(2, VOCAB)
    sample(logits, [spec(), spec()], [None, None], argmax=argmax)
    assert len(seen) == 1
    sample(logits, [spec(), spec(frequency_penalty=1.0)], [None, None], argmax=argmax,
           histories=[TokenHistory([0], 1)] * 2)
    assert len(seen) == 1


def test_penalties_without_histories_are_refused() -> None:
    with pytest.raises(ValueError, match="histories"):
        sample(torch.randn(1, VOCAB), [spec(presence_penalty=1.0)], [None])
