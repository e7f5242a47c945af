"""Structured output on the worker (worker_svc.token_mask): packed bitmasks checked against
the step and unpacked bit by bit as a plain loop reads them, applied to the masked rows only,
and a real step of the model whose greedy and seeded tokens stay inside the mask."""

import random
from pathlib import Path

import pytest
import torch

from services.codec import Codec
from services.model_config import ModelConfig
from services.wire import NewRequest, SamplingSpec, StepInput, StepOutput, TokenMask, ToWorker
from tests.worker_svc.common import GREEDY, PROMPTS
from worker_svc.runner import ModelRunner
from worker_svc.token_mask import apply_token_masks, mask_num_bytes, mask_rows, unpack_masks


def pack(allowed: set[int], vocab_size: int) -> bytes:
    """The wire layout, written the slow way: bit i % 32 of little-endian int32 word i // 32."""
    words = [0] * (-(-vocab_size // 32))
    for token_id in allowed:
        words[token_id // 32] |= 1 << (token_id % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_mask_num_bytes() -> None:
    assert mask_num_bytes(1) == 4
    assert mask_num_bytes(32) == 4
    assert mask_num_bytes(33) == 8
    assert mask_num_bytes(49152) == 49152 // 8


def test_unpack_matches_the_bit_layout() -> None:
    rng = random.Random(0)
    vocab_size = 1000    # not a multiple of 32: the last word's high bits are cut off
    sets = [set(rng.sample(range(vocab_size), k)) for k in (1, 37, 999)] + [{31, 32, 999}]
    masks = [TokenMask(f"r{i}", pack(s, vocab_size)) for i, s in enumerate(sets)]
    allowed = unpack_masks(masks, vocab_size, torch.device("cpu"))
    assert allowed.shape == (len(sets), vocab_size) and allowed.dtype == torch.bool
    for row, s in zip(allowed, sets):
        assert set(row.nonzero()[:, 0].tolist()) == s


def test_masked_rows_only_keep_allowed_tokens() -> None:
    vocab_size = 70
    logits = torch.randn(3, vocab_size)
    before = logits.clone()
    masks = [TokenMask("c", pack({5, 69}, vocab_size)), TokenMask("a", pack({0}, vocab_size))]
    apply_token_masks(logits, masks, ["a", "b", "c"])
    assert torch.equal(logits[1], before[1])                   # "b" has no mask
    assert logits[0, 0] == before[0, 0] and torch.isinf(logits[0, 1:]).all()
    kept = {5, 69}
    for i in range(vocab_size):
        if i in kept:
            assert logits[2, i] == before[2, i]
        else:
            assert logits[2, i] == float("-inf")
    assert logits[2].argmax().item() in kept


def test_no_masks_leaves_logits_alone() -> None:
    logits = torch.randn(2, 40)
    before = logits.clone()
    assert apply_token_masks(logits, [], ["a", "b"]) is logits
    assert torch.equal(logits, before)


@pytest.mark.parametrize("masks, error", [
    ([TokenMask("a", b"\0" * 8)], "is 8 bytes"),               # 100 ids need 4 words
    ([TokenMask("a", b"\xff" * 16), TokenMask("a", b"\xff" * 16)], "two token masks"),
    ([TokenMask("zzz", b"\xff" * 16)], "does not sample in this step"),
])
def test_bad_masks_are_refused(masks: list[TokenMask], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        mask_rows(masks, ["a", "b"], 100)


def test_wire_limits_the_mask_size() -> None:
    codec = Codec(ToWorker)
    too_big = StepInput(0, [], [], [], [TokenMask("a", b"\0" * ((1 << 18) + 4))])
    with pytest.raises(Exception, match="length"):
        codec.decode(codec.encode(too_big))
    empty = StepInput(0, [], [], [], [TokenMask("a", b"")])
    with pytest.raises(Exception, match="length"):
        codec.decode(codec.encode(empty))
    ok = StepInput(0, [], [], [], [TokenMask("a", b"\x01\0\0\0")])
    assert codec.decode(codec.encode(ok)) == ok


@pytest.fixture(scope="module")
def runner(model_config: ModelConfig, model_path: Path) -> ModelRunner:
    runner = ModelRunner(model_config, model_path, torch.float32, "worker-0")
    runner.init_cache(16, 16)
    return runner


@pytest.mark.parametrize("sampling", [
    GREEDY, SamplingSpec(temperature=1.5, top_p=1.0, top_k=-1, seed=7, num_logprobs=None)])
def test_a_step_samples_inside_its_mask(runner: ModelRunner, model_config: ModelConfig,
                                        sampling: SamplingSpec) -> None:
    """The model's own favourite is masked out; the token drawn is one the mask allows, while
    an unmasked request in the same step is unaffected."""
    prompt = PROMPTS["The capital of France is"]
    vocab_size = model_config.vocab_size
    allowed = {11, 1234, 40000}
    step = StepInput(1, [
        NewRequest("free", list(prompt), len(prompt), GREEDY, [[1]], 0, len(prompt)),
        NewRequest("masked", list(prompt), len(prompt), sampling, [[2]], 0, len(prompt))],
        [], [], [TokenMask("masked", pack(allowed, vocab_size))])
    output = runner.execute(step)
    assert isinstance(output, StepOutput) and output.error is None
    free, masked = output.sampled_token_ids
    assert free not in allowed                  # the model would not pick these on its own
    assert masked in allowed
    runner.execute(StepInput(2, [], [], ["free", "masked"]))


def test_a_bad_mask_fails_the_step(runner: ModelRunner, model_config: ModelConfig) -> None:
    prompt = PROMPTS["def fibonacci(n):"]
    step = StepInput(3, [NewRequest("r", list(prompt), len(prompt), GREEDY, [[3]], 0,
                                    len(prompt))], [], [], [TokenMask("r", b"\xff" * 8)])
    with pytest.raises(ValueError, match="token mask"):
        runner.execute(step)
