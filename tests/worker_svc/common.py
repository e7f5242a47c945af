"""Shared by the worker tests: prompts, sampling specs, greedy comparison against HF, and the
C kernels a model is built with."""

from collections.abc import Callable

import pytest
import torch

from services.model_config import ModelConfig
from services.wire import SamplingSpec
from worker_svc.kernel_choice import choose_kernels
from worker_svc.kernels import LayerKernels
from worker_svc.kernels.cpu import CpuLevel, detect_level

# Token ids from HF's tokenizer for the default GGUF (fixed here: loading it takes seconds).
PROMPTS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "def fibonacci(n):": [1604, 3987, 46477, 24, 94, 727],
    "Once upon a time, in a small village,": [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],
    "chat: What is 2+2?": [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531,
                           198],
}

GREEDY = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=None, num_logprobs=None)

# Reference steps whose two best logits are closer than this may go either way.
NEAR_TIE = 1e-3


def hf_greedy(hf_model, prompt: list[int], num_new_tokens: int  # type: ignore[no-untyped-def]
              ) -> tuple[list[int], list[tuple[int, int] | None]]:
    """HF's greedy continuation (up to its EOS) and, per step, its top-2 token ids where
    they nearly tie. (min_new_tokens would suppress EOS and change the greedy choice.)"""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens,
                                do_sample=False,
                                output_logits=True, return_dict_in_generate=True,
                                pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    near_tie: list[tuple[int, int] | None] = []
    for logits in out.logits:
        values, ids = logits[0].float().topk(2)
        tie = bool(values[0] - values[1] < NEAR_TIE)
        near_tie.append((int(ids[0]), int(ids[1])) if tie else None)
    return tokens, near_tie


def assert_greedy_match(ours: list[int], reference: list[int],
                        near_tie: list[tuple[int, int] | None]) -> None:
    """Equal token for token, up to the first near-tie step (either of its two is fine)."""
    assert len(ours) >= len(reference)
    for i, (mine, theirs) in enumerate(zip(ours, reference)):
        tie = near_tie[i]
        if tie is not None:
            assert mine in tie, f"token {i}: {mine} is neither of the near-tied {tie}"
            return
        assert mine == theirs, f"token {i}: {mine} != {theirs}\nours {ours}\nhf   {reference}"


def level_params(with_none: bool = False) -> list:  # type: ignore[type-arg]
    """Every kernel level (and level none, torch only, if asked) as pytest params. Those above
    this CPU's are skipped here (their code would die on an illegal instruction) and run on CI
    machines that have them; every level's code still compiles on any machine
    (test_kernel_build.py)."""
    detected = detect_level()
    levels = [CpuLevel.NONE] * with_none + [CpuLevel.AVX2, CpuLevel.AVX512,
                                            CpuLevel.AVX512_BF16, CpuLevel.AMX]
    return [pytest.param(level, id=level.label, marks=pytest.mark.skipif(
        level > detected, reason=f"this CPU's best level is {detected.label}"))
        for level in levels]


def cpu_kernels(config: ModelConfig, dtype: torch.dtype, level: CpuLevel | None = None
                ) -> LayerKernels:
    """The C kernels a whole-width model of `config` runs at `level` (None: this CPU's best),
    as worker_svc.kernel_choice gives them to a CPU worker."""
    return choose_kernels(torch.device("cpu"), level, config.head_dim,
                          config.num_heads // config.num_kv_heads, dtype, "c")


def on_threads(count: int, kernel: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """kernel(*args) with torch's (and so the C kernels' OpenMP) thread pool at `count`."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(count)
        return kernel(*args)
    finally:
        torch.set_num_threads(threads)
