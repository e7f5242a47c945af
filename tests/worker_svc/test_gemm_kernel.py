"""gemm_bf16.c (the decode-size bfloat16 matmul) against float32 matmul, and how Linear and
the model route to it."""

from pathlib import Path

import pytest
import torch

from services.model_config import ModelConfig
from tests.worker_svc.common import PROMPTS
from worker_svc import kernels
from worker_svc.attention import build_attention_metadata
from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches
from worker_svc.model import llama
from worker_svc.model.weights import load_weights

HAS_BF16 = kernels._cpu_has("avx512_bf16")


@pytest.fixture(scope="module")
def gemm() -> kernels.Bf16Gemm:
    kernel = kernels.bf16_gemm_kernel()
    if not HAS_BF16:
        # Nothing to run here; what must hold is that the model never tries.
        assert kernel is None
        pytest.skip("this CPU has no AVX512-BF16: the kernel is not built (oneDNN is used)")
    assert kernel is not None, "AVX512-BF16 CPU, but gemm_bf16.c did not build"
    return kernel


def _close_to_float32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w.float().T
    # float32 sums in another order, then one bfloat16 rounding (relative 2^-8).
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("m", [1, 7, 8, 9, 64, 130, 300])   # row tiles of 8, chunks of 256
@pytest.mark.parametrize("n,k", [(48, 2), (96, 64), (480, 576), (144, 1536)])
def test_matches_float32_matmul(gemm: kernels.Bf16Gemm, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    _close_to_float32(gemm(x, gemm.pack(w)), x, w)


def test_same_result_on_any_thread_count(gemm: kernels.Bf16Gemm) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=gen).bfloat16()
    packed = gemm.pack(torch.randn(960, 576, generator=gen).bfloat16())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, gemm(x, packed))


def test_rejects_shapes_it_does_not_take(gemm: kernels.Bf16Gemm) -> None:
    assert not gemm.fits(torch.zeros(50, 64, dtype=torch.bfloat16))     # n not a multiple of 48
    assert not gemm.fits(torch.zeros(48, 63, dtype=torch.bfloat16))     # odd k
    assert not gemm.fits(torch.zeros(48, 64))                           # float32
    assert not gemm.fits(torch.zeros(48, 0, dtype=torch.bfloat16))      # nothing to multiply
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(torch.zeros(50, 64, dtype=torch.bfloat16))
    packed = gemm.pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected contiguous bfloat16"):
        gemm(torch.zeros(4, 62, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="expected contiguous bfloat16"):
        gemm(torch.zeros(64, 4, dtype=torch.bfloat16).T, packed)
    assert gemm(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 48)


def test_linear_uses_it_up_to_the_threshold_then_onednn(gemm: kernels.Bf16Gemm) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    linear = llama.Linear([w], gemm=gemm)
    assert linear.gemm is gemm
    small = torch.randn(llama.OWN_GEMM_MAX_TOKENS, 64, generator=gen).bfloat16()
    assert torch.equal(linear(small), gemm(small, linear.gemm_packed))
    large = torch.randn(llama.OWN_GEMM_MAX_TOKENS + 1, 64, generator=gen).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(large, linear.packed, None, "none", [], "")
    assert torch.equal(linear(large), onednn)
    _close_to_float32(linear(large), large, w)
    # A shape the kernel does not take stays on oneDNN alone.
    assert llama.Linear([torch.randn(50, 64).bfloat16()], gemm=gemm).gemm is None


def test_model_logits_with_and_without_it_agree(
        gemm: kernels.Bf16Gemm, model_path: Path, model_config: ModelConfig,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The real SmolLM2 weights in bfloat16, all prompts in one step of under 128 tokens: every
    # matmul of the model (LM head included) through the kernel, against oneDNN.
    weights = load_weights(model_path, model_config, torch.bfloat16)
    ours = llama.LlamaModel(model_config, torch.bfloat16)
    ours.load_weights(weights)
    assert ours.kernels.gemm is not None and ours.lm_head.gemm is not None
    assert all(layer.gate_up_proj.gemm is not None for layer in ours.layers)
    monkeypatch.setattr(llama, "bf16_gemm_kernel", lambda: None)
    onednn = llama.LlamaModel(model_config, torch.bfloat16)
    onednn.load_weights(weights)
    assert onednn.lm_head.gemm is None
    fp32 = llama.LlamaModel(model_config, torch.float32)
    fp32.load_weights(load_weights(model_path, model_config, torch.float32))

    prompts = list(PROMPTS.values())[:4]
    lens = [len(p) for p in prompts]
    assert 2 * llama.INT4_MAX_TOKENS < sum(lens) <= llama.OWN_GEMM_MAX_TOKENS
    block = 8
    tables, next_block = [], 1
    for n in lens:
        tables.append(list(range(next_block, next_block + -(-n // block))))
        next_block = tables[-1][-1] + 1
    meta = build_attention_metadata(lens, [0] * len(lens), tables, block, next_block)
    ids = torch.tensor([t for p in prompts for t in p])
    logits = []
    with torch.inference_mode():
        for model in (ours, onednn, fp32):
            spec = KvLayerSpec(block, model_config.num_kv_heads, model_config.head_dim,
                               model.dtype)
            caches = allocate_kv_caches([spec] * model_config.num_layers, next_block)
            logits.append(model.compute_logits(*model.forward(ids, None, None, meta.positions,
                                                              meta, caches)).float())
    ours_logits, onednn_logits, expected = logits
    # Both are bfloat16 runs of the float32 model; ours strays from it no more than oneDNN's.
    ours_error = (ours_logits - expected).abs().mean()
    onednn_error = (onednn_logits - expected).abs().mean()
    print(f"mean error against float32: ours {ours_error:.4f}, oneDNN {onednn_error:.4f}")
    assert ours_error < 1.2 * onednn_error
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() > 10
    assert torch.equal(ours_logits.argmax(-1)[clear], expected.argmax(-1)[clear])
