"""min_tokens on the worker (worker_svc.min_tokens): a model rigged to want EOS at once (its
LM head's EOS logit raised far above every other) still gives exactly min_tokens tokens before
EOS, greedy or sampled, launched ahead or not; stop token ids are held back with EOS; the
logprobs stay the raw model's; bad ids fail the step. (test_sampling_no_sync.py masks on a GPU
without reading it back.)"""

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from services.codec import Codec, DecodeError
from services.model_config import ModelConfig
from services.wire import NewRequest, RunningRequest, SamplingSpec, StepInput
from tests.worker_svc.common import GREEDY, PROMPTS
from worker_svc.pending_tokens import PENDING
from worker_svc.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT = PROMPTS["The capital of France is"]
STOP_ID = 7                 # a stop token id the rig makes the second favourite
NUM_STEPS = 8


@pytest.fixture(scope="module")
def rigged(model_path: Path, model_config: ModelConfig) -> Iterator[ModelRunner]:
    """The default model with its LM head's EOS rows (and STOP_ID's, less) raised by a
    constant: unmasked, every step samples EOS."""
    runner = ModelRunner(model_config, model_path, torch.float32, "worker-0")
    model = runner.model
    head = model.lm_head
    assert head is not None
    eos = list(model_config.eos_token_ids)

    def wants_eos(x: torch.Tensor) -> torch.Tensor:
        logits = head(x).clone()
        logits[:, eos] += 1000.0
        logits[:, STOP_ID] += 500.0
        return logits

    model.lm_head = wants_eos  # type: ignore[assignment]
    yield runner
    model.lm_head = head


def spec(min_tokens: int, ids: list[int], **kw: object) -> SamplingSpec:
    return msgspec.structs.replace(GREEDY, min_tokens=min_tokens, min_tokens_ids=ids,
                                   **kw)  # type: ignore[arg-type]


def run(runner: ModelRunner, specs: dict[str, SamplingSpec], ahead: bool
        ) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Each request prefills PROMPT, then decodes one token a step for NUM_STEPS steps
    (`ahead`: each step launched before the one before it finished). Its tokens and the
    sampled tokens' logprobs (where it asked)."""
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    names = list(specs)
    n = len(PROMPT)
    blocks = {name: [[1 + 8 * i + b for b in range(8)]] for i, name in enumerate(names)}
    steps = [StepInput(0, [NewRequest(name, PROMPT, n, specs[name], blocks[name], 0, n)
                           for name in names], [], [])]
    steps += [StepInput(k, [], [RunningRequest(name, n + k - 1, 1, [[]], []) for name in names],
                        []) for k in range(1, NUM_STEPS)]
    tokens: dict[str, list[int]] = {name: [] for name in names}
    logprobs: dict[str, list[float]] = {name: [] for name in names}

    def take(launched) -> None:  # type: ignore[no-untyped-def]
        output = runner.finish(launched)
        for name, token, lp in zip(output.request_ids, output.sampled_token_ids,
                                   output.logprobs, strict=True):
            tokens[name].append(token)
            if lp is not None:
                logprobs[name].append(lp.logprob)

    previous = None
    for step in steps:
        launched = runner.launch(step)
        if ahead:        # the mask counted a placeholder: nothing was read back at launch
            assert all(runner.input_batch.requests[name].token_ids[-1] == PENDING
                       for name in names)
        if previous is not None:
            take(previous)
        previous = launched
        if not ahead:
            take(previous)
            previous = None
    if previous is not None:
        take(previous)
    return tokens, logprobs


@pytest.mark.parametrize("ahead", [False, True])
def test_min_tokens_hold_eos_back_on_a_model_that_wants_it_at_once(
        rigged: ModelRunner, model_config: ModelConfig, ahead: bool) -> None:
    eos = model_config.eos_token_ids[0]
    ids = sorted({*model_config.eos_token_ids, STOP_ID})
    specs = {
        "free": GREEDY,                                    # the rig's control: EOS at once
        "greedy": spec(4, ids),
        "sampled": spec(3, ids, temperature=0.8, seed=5, num_logprobs=1),
        "penalized": spec(2, ids, repetition_penalty=1.3),
        "eos-only": spec(4, list(model_config.eos_token_ids)),   # STOP_ID not masked
    }
    tokens, logprobs = run(rigged, specs, ahead)
    assert tokens["free"][0] == eos
    for name, min_tokens in (("greedy", 4), ("sampled", 3), ("penalized", 2)):
        out = tokens[name]
        assert not set(out[:min_tokens]) & set(ids), (name, out)
        assert out[min_tokens] == eos, (name, out)      # the first token it may be
    # Without STOP_ID among the masked ids, the second favourite wins while EOS is held back.
    assert tokens["eos-only"][:4] == [STOP_ID] * 4 and tokens["eos-only"][4] == eos
    # Logprobs are the raw model's: a held-back step's token is far below EOS's 1000.
    assert all(lp < -100 for lp in logprobs["sampled"][:3])
    assert logprobs["sampled"][3] > -1e-3


def test_ids_outside_the_vocabulary_fail_the_step(rigged: ModelRunner,
                                                  model_config: ModelConfig) -> None:
    rigged.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    bad = spec(2, [model_config.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rigged.input_batch.apply(StepInput(0, [NewRequest("r", PROMPT, len(PROMPT), bad,
                                                          [[1, 2]], 0, len(PROMPT))], [], []))


def test_the_wire_refuses_a_negative_min_tokens() -> None:
    codec = Codec(SamplingSpec)
    good = spec(3, [2])
    assert codec.decode(codec.encode(good)) == good
    raw = codec.encode(msgspec.structs.replace(good, min_tokens=-1))   # (replace: unchecked)
    # Array-like structs name the field by position: min_tokens is the 12th after the tag.
    with pytest.raises(DecodeError, match=r">= 0 - at `\$\[12\]`"):
        codec.decode(raw)
