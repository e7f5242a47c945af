"""What an 8-bit KV cache costs in accuracy, bounded (issue 39, point 2): the real SmolLM2
weights with an fp8 cache against the same model with a float32 / bfloat16 cache, on a slice
of the shared workload's chat prompts, the worker tests' short and chat prompts and a long
chat prompt, teacher-forced over 33 decode steps (bench/quant_accuracy.py; its full run over
all 64 workload prompts is in the README).

The bounds sit above what was measured on AMD Zen 5 (2 cores, level avx512_bf16), full run,
69 prompts x 48 steps, fp32 compute: e4m3 mean |delta logprob| 0.056, max 1.39, top-1 97.1 %
outside near-ties, 14 of 69 prompts token-exact for 32 tokens. For scale, bfloat16 compute
against float32 (the same harness): mean 0.019, top-1 99.7 %. e4m3's 3 mantissa bits are the
cost, not its range: per-layer calibrated scales measured the same as vLLM's 1.0.
"""

from pathlib import Path

import pytest
import torch

from bench.quant_accuracy import Agreement, Variant, compare, long_chat_prompt, workload_prompts
from scheduler_svc.frontend.tokenizer import load_tokenizer
from tests.worker_svc.common import PROMPTS

STEPS = 33


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(model_path)
    chosen = workload_prompts(tokenizer)[::8]        # 8 of the 64 (none without ../shared)
    return chosen + list(PROMPTS.values()) + [long_chat_prompt(tokenizer, repeats=6)]


def check(result: Agreement, mean: float, worst: float, top1: float, exact: float) -> None:
    figures = (f"mean {result.mean_abs_dlogprob:.4f} max {result.max_abs_dlogprob:.3f} "
               f"top-1 {result.top1_outside_near_ties:.4f} exact "
               f"{result.exact_prompts}/{result.prompts}")
    assert result.mean_abs_dlogprob <= mean, figures
    assert result.max_abs_dlogprob <= worst, figures
    assert result.top1_outside_near_ties >= top1, figures
    assert result.exact_prompts >= exact * result.prompts, figures
    assert result.mean_abs_dlogprob > 0, "identical: the 8-bit cache was never used"


@pytest.mark.parametrize("kv, bounds", [
    ("fp8", (0.09, 2.5, 0.95, 0.15)),
    ("fp8_e5m2", (0.2, 4.0, 0.88, 0.0)),
], ids=["e4m3", "e5m2"])
def test_fp8_cache_against_float32(prompts: list[list[int]], kv: str,
                                   bounds: tuple[float, float, float, float]) -> None:
    result = compare(prompts, Variant(torch.float32), Variant(torch.float32, kv), STEPS)
    check(result, *bounds)


def test_fp8_cache_against_bfloat16(prompts: list[list[int]]) -> None:
    result = compare(prompts, Variant(torch.bfloat16), Variant(torch.bfloat16, "fp8"), STEPS)
    check(result, 0.12, 3.0, 0.93, 0.1)
