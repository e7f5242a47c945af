"""--kv-cache-dtype (worker_svc.kernels.kv_quant): the names and what they store, the torch
twin's quantization against torch's own conversion, and a runner sized, sliced and attending
with an 8-bit cache (twice the blocks of bfloat16, four times float32's, for one budget)."""

from pathlib import Path

import pytest
import torch

from services.model_config import ModelConfig
from tests.worker_svc.common import GREEDY, PROMPTS
from tests.worker_svc.test_runner import MiniScheduler
from worker_svc.attention import build_attention_metadata, paged_attention
from worker_svc.kernels.kv_quant import (
    FP8_MAX,
    KvScales,
    dequantize,
    kv_cache_dtype,
    quantize,
    write_slots,
)
from worker_svc.kernels.paged_attention_torch import reference_paged_attention
from worker_svc.kv_cache import KvLayerSpec, num_blocks_for_budget
from worker_svc.runner import ModelRunner

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_vllm_names_map_to_their_formats() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32) is torch.float32
    assert kv_cache_dtype("fp8", torch.float32) is torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3, fp8_e5m2"):
        kv_cache_dtype("int4", torch.float32)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_quantize_saturates_and_rounds_as_torch(dtype: torch.dtype) -> None:
    limit = FP8_MAX[dtype]
    x = torch.cat([torch.randn(4096) * 3, torch.tensor([limit * 4, -limit * 4, 1e-9, -0.0])])
    q = quantize(x, 1.0, dtype)
    assert q.dtype == dtype
    assert torch.equal(q.float()[-4:-2], torch.tensor([limit, -limit]))    # saturated
    assert torch.equal(q[:-4].view(torch.uint8), x[:-4].to(dtype).view(torch.uint8))
    # a scale divides on the way in and multiplies on the way out
    scaled = quantize(x[:-4] * 8, 8.0, dtype)
    assert torch.equal(scaled.view(torch.uint8), q[:-4].view(torch.uint8))
    assert torch.equal(dequantize(scaled, 8.0, torch.float32), q[:-4].float() * 8)
    rel = ((dequantize(q[:-4], 1.0, torch.float32) - x[:-4]).abs()
           / x[:-4].abs().clamp_min(1.0)).max()
    assert rel <= (2 ** -4 if dtype == torch.float8_e4m3fn else 2 ** -3)   # half an ulp


def test_page_bytes_and_budget_count_the_smaller_pages() -> None:
    specs = {dtype: [KvLayerSpec(16, 3, 64, dtype)] * 30
             for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)}
    assert specs[torch.float8_e4m3fn][0].page_bytes == 2 * 16 * 3 * 64
    budget = 256 << 20
    blocks = {dtype: num_blocks_for_budget(budget, s) for dtype, s in specs.items()}
    assert blocks[torch.float8_e4m3fn] == 2 * blocks[torch.bfloat16] == 4 * blocks[torch.float32]


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path_matches_the_reference_on_an_8bit_cache(dtype: torch.dtype,
                                                           compute: torch.dtype) -> None:
    """The torch twin (gathered, padded) against the token-by-token reference, both reading
    the same stored bytes: decodes and a prefill chunk with context, scales other than 1."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block, kv_heads, dim, group = 24, 4, 2, 32, 3
    query_lens, context_lens = [1, 1, 5], [6, 9, 3]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8]]
    rows = sum(query_lens)
    q = torch.randn(rows, kv_heads * group, dim, generator=gen).to(compute)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(compute)
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(compute)
    scales = KvScales(0.05, 2.0)
    base = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=dtype)
    history = torch.randn(2, num_blocks * block, kv_heads, dim, generator=gen)
    base.view(torch.uint8).copy_(torch.stack([
        quantize(history[0], scales.k_scale, dtype), quantize(history[1], scales.v_scale, dtype)
    ]).view(torch.uint8).view(base.shape))
    ours, ref = base.clone(), base.clone()
    meta = build_attention_metadata(query_lens, context_lens, tables, block, num_blocks)
    out = paged_attention(q, k, v, ours, meta, scales=scales)
    expected = reference_paged_attention(q, k, v, ref, query_lens, context_lens, tables,
                                         scales=scales)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    tol = 2e-2 if compute == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_write_slots_stores_what_quantize_gives() -> None:
    cache = torch.zeros(2, 4, 2, 1, 8, dtype=torch.float8_e5m2)
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    write_slots(cache, torch.tensor([1, 6, 2]), k, v, KvScales(0.5, 4.0))
    flat = cache.view(2, 8, 1, 8)
    assert torch.equal(flat[0, [1, 6, 2]].view(torch.uint8),
                       quantize(k, 0.5, torch.float8_e5m2).view(torch.uint8))
    assert torch.equal(flat[1, [1, 6, 2]].view(torch.uint8),
                       quantize(v, 4.0, torch.float8_e5m2).view(torch.uint8))
    assert not flat[:, [0, 3, 4, 5, 7]].view(torch.uint8).any()


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_a_runner_sizes_slices_and_serves_with_an_8bit_cache(model_path: Path,
                                                              model_config: ModelConfig,
                                                              kv: str) -> None:
    dense = ModelRunner(model_config, model_path, torch.float32, "w-dense")
    runner = ModelRunner(model_config, model_path, torch.float32, "w-fp8", kv_cache_dtype=kv)
    try:
        assert runner.kv_dtype == kv_cache_dtype(kv, torch.float32)
        assert 4 * runner.kv_bytes_per_block(16) == dense.kv_bytes_per_block(16)
        budget = 64 << 20
        assert runner.num_blocks_for_budget(budget, 16) == budget // runner.kv_bytes_per_block(16)
        kv_slice = runner.kv_slice()
        assert kv_slice.dtype == str(runner.kv_dtype).removeprefix("torch.")
        assert kv_slice.model == dense.kv_slice().model + "+k1v1"   # never matches auto's
        runner.init_cache(256, 4)
        assert all(cache.dtype == runner.kv_dtype for cache in runner.kv_caches)
        scheduler = MiniScheduler(token_budget=12, send_tokens=False)
        for i, prompt in enumerate(PROMPTS.values()):
            scheduler.add(f"r{i}", prompt, 6, GREEDY)
        while scheduler.has_work:
            scheduler.update(runner.execute(scheduler.schedule()))
        outputs = [scheduler.outputs(f"r{i}") for i in range(len(PROMPTS))]
        assert all(len(tokens) == 6 for tokens in outputs)
        assert all(cache.view(torch.uint8).any() for cache in runner.kv_caches)
    finally:
        runner.close()
        dense.close()


def test_pipeline_stages_with_an_fp8_cache_give_the_tokens_of_one(model_path: Path,
                                                                  model_config: ModelConfig
                                                                  ) -> None:
    """Two stages, each holding its layers' fp8 KV, give one fp8 runner's greedy tokens."""
    def generate(stages: list[ModelRunner]) -> dict[str, list[int]]:
        scheduler = MiniScheduler(token_budget=9, send_tokens=len(stages) > 1)
        for name in ("The capital of France is", "def fibonacci(n):"):
            scheduler.add(name, PROMPTS[name], 8)
        while scheduler.has_work:
            step = scheduler.schedule()
            out = stages[0].execute(step)
            for stage in stages[1:]:
                out = stage.execute(step, out)
            scheduler.update(out)
        return {name: scheduler.outputs(name) for name in scheduler.requests}

    runners = [ModelRunner(model_config, model_path, torch.float32, "one", kv_cache_dtype="fp8"),
               ModelRunner(model_config, model_path, torch.float32, "pp0", 0, 13, False,
                           kv_cache_dtype="fp8"),
               ModelRunner(model_config, model_path, torch.float32, "pp1", 13, None, True,
                           kv_cache_dtype="fp8")]
    try:
        for runner in runners:
            runner.init_cache(128, 4)
        assert generate(runners[1:]) == generate(runners[:1])
    finally:
        for runner in runners:
            runner.close()
