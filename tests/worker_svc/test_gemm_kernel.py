"""The matmul kernels (gemm_bf16.c, gemm_fma.c) against float32 matmul, at each CPU level this
machine can run, and how Linear and the model route to them."""

from pathlib import Path

import pytest
import torch

from services.model_config import ModelConfig
from tests.worker_svc.common import PROMPTS, cpu_kernels, on_threads
from worker_svc.attention import build_attention_metadata
from worker_svc.kernels import AmxGemm, Bf16Gemm, FmaGemm, Gemm, TorchInt4, load_cpu_kernels
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.gemm import bf16_gemm, fma_gemm, quant_gemm, quant_kernels
from worker_svc.kernels.quant_blocks import QuantBlocks
from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches
from worker_svc.model import llama
from worker_svc.model.weights import load_weights


def _gemm(level: CpuLevel, dtype: torch.dtype, kind: str = "fma") -> Gemm:
    kernel = bf16_gemm(level) if kind == "bf16" else fma_gemm(level, dtype)
    assert kernel is not None, f"gemm_{kind} did not build at {level.label} (see the log)"
    return kernel


def _kinds(level: CpuLevel, dtype: torch.dtype) -> list[str]:
    """The kernels this level has for dtype: the FMA kernel always, VDPBF16PS where native."""
    return ["fma"] + ["bf16"] * (level.native_bf16 and dtype == torch.bfloat16)


def _close_to_float32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w.float().T
    if out.dtype == torch.float32:     # float32 sums in another order
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:                              # ... then one bfloat16 rounding (relative 2^-8)
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 6, 8, 9, 64, 130, 700])  # tiles of 6 (AVX2) / 8, chunks
@pytest.mark.parametrize("n,k", [(48, 2), (17, 3), (96, 64), (480, 576), (144, 1536)])
def test_matches_float32_matmul(kernel_level: CpuLevel, dtype: torch.dtype, m: int, n: int,
                                k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    for kind in _kinds(kernel_level, dtype):
        gemm = _gemm(kernel_level, dtype, kind)
        if gemm.fits(w):     # gemm_bf16 takes n % 48 == 0 and even k (oneDNN the rest)
            _close_to_float32(gemm(x, gemm.pack(w)), x, w)


def test_fma_kernel_takes_any_shape_and_reads_no_padding(kernel_level: CpuLevel) -> None:
    # Odd k pads each bfloat16 pair with a zero weight; a NaN in the row past k must not leak.
    gemm = _gemm(kernel_level, torch.bfloat16)
    assert isinstance(gemm, FmaGemm)
    wide = torch.full((7, 6), float("nan")).bfloat16()
    wide[:, :5] = torch.randn(7, 5).bfloat16()
    x = wide[:, :5].contiguous()
    w = torch.randn(11, 5).bfloat16()
    out = gemm(x, gemm.pack(w))
    assert torch.isfinite(out).all()
    _close_to_float32(out, x, w)
    assert gemm(torch.zeros(0, 5, dtype=torch.bfloat16), gemm.pack(w)).shape == (0, 11)
    with pytest.raises(ValueError, match="expected contiguous"):
        gemm(torch.zeros(4, 8, dtype=torch.bfloat16).T, gemm.pack(w))
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(w.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_result_on_any_thread_count(kernel_level: CpuLevel, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=gen).to(dtype)
    w = torch.randn(960, 576, generator=gen).to(dtype)
    for kind in _kinds(kernel_level, dtype):
        gemm = _gemm(kernel_level, dtype, kind)
        packed = gemm.pack(w)
        assert torch.equal(on_threads(1, gemm, x, packed), gemm(x, packed))


@pytest.mark.skipif(detect_level() < CpuLevel.AVX512_BF16,
                    reason="gemm_bf16.c runs on AVX512-BF16 CPUs only")
def test_bf16_kernel_rejects_shapes_it_does_not_take() -> None:
    gemm = _gemm(CpuLevel.AVX512_BF16, torch.bfloat16, "bf16")
    assert isinstance(gemm, Bf16Gemm)
    assert not gemm.fits(torch.zeros(50, 64, dtype=torch.bfloat16))     # n not a multiple of 48
    assert not gemm.fits(torch.zeros(48, 63, dtype=torch.bfloat16))     # odd k
    assert not gemm.fits(torch.zeros(48, 64))                           # float32
    assert not gemm.fits(torch.zeros(48, 0, dtype=torch.bfloat16))      # nothing to multiply
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(torch.zeros(50, 64, dtype=torch.bfloat16))
    packed = gemm.pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected contiguous"):
        gemm(torch.zeros(4, 62, dtype=torch.bfloat16), packed)
    assert gemm(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 48)


def test_linear_routes_by_level_and_batch_size(kernel_level: CpuLevel) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    kernels = load_cpu_kernels(kernel_level, 16, 1, torch.bfloat16)
    linear = llama.Linear([w], kernels=kernels)
    assert linear.gemm is kernels.gemm is not None
    most = linear.gemm.max_rows or 64
    small = torch.randn(most, 64, generator=gen).bfloat16()
    assert torch.equal(linear(small), linear.gemm(small, linear.gemm_weight))
    large = torch.randn(300, 64, generator=gen).bfloat16()
    if kernel_level.native_bf16:    # the kernel up to 128 rows (gemm_amx.c at amx), then oneDNN
        assert most == 128 and isinstance(linear.gemm, AmxGemm) == (kernel_level >= CpuLevel.AMX)
        assert linear.onednn is not None and linear.weight is None
        for x in (large, torch.randn(most + 1, 64, generator=gen).bfloat16()):
            onednn = torch.ops.mkldnn._linear_pointwise(x, linear.onednn, None, "none", [], "")
            assert torch.equal(linear(x), onednn)
        # A shape the kernel does not take stays on oneDNN alone.
        assert llama.Linear([torch.randn(50, 64).bfloat16()], kernels=kernels).gemm is None
    else:                           # the FMA kernel for every size; no other copy kept
        assert linear.onednn is None and linear.weight is None
        assert torch.equal(linear(large), linear.gemm(large, linear.gemm_weight))
    _close_to_float32(linear(large), large, w)


def test_model_logits_at_each_level_agree_with_float32(
        kernel_level: CpuLevel, model_path: Path, model_config: ModelConfig) -> None:
    # The real SmolLM2 weights in bfloat16, four prompts in one step of under 128 tokens:
    # every matmul of the model (LM head included) through the level's kernel, against the
    # torch-only model (level none).
    weights = load_weights(model_path, model_config, torch.bfloat16)
    ours = llama.LlamaModel(model_config, torch.bfloat16,
                            kernels=cpu_kernels(model_config, torch.bfloat16, kernel_level))
    ours.load_weights(weights)
    assert ours.kernels.gemm is not None and ours.lm_head.gemm is not None
    assert all(layer.gate_up_proj.gemm is not None for layer in ours.layers)
    plain = llama.LlamaModel(model_config, torch.bfloat16,
                             kernels=cpu_kernels(model_config, torch.bfloat16, CpuLevel.NONE))
    plain.load_weights(weights)
    assert plain.lm_head.gemm is None
    fp32 = llama.LlamaModel(model_config, torch.float32,
                            kernels=cpu_kernels(model_config, torch.float32, CpuLevel.NONE))
    fp32.load_weights(load_weights(model_path, model_config, torch.float32))

    prompts = list(PROMPTS.values())[:4]
    lens = [len(p) for p in prompts]
    assert 16 < sum(lens) <= 128      # past the small-step kernels' rows
    block = 8
    tables, next_block = [], 1
    for n in lens:
        tables.append(list(range(next_block, next_block + -(-n // block))))
        next_block = tables[-1][-1] + 1
    meta = build_attention_metadata(lens, [0] * len(lens), tables, block, next_block)
    ids = torch.tensor([t for p in prompts for t in p])
    logits = []
    with torch.inference_mode():
        for model in (ours, plain, fp32):
            spec = KvLayerSpec(block, model_config.num_kv_heads, model_config.head_dim,
                               model.dtype)
            caches = allocate_kv_caches([spec] * model_config.num_layers, next_block)
            logits.append(model.compute_logits(*model.forward(ids, None, None, meta.positions,
                                                              meta, caches)).float())
    ours_logits, plain_logits, expected = logits
    # Both are bfloat16 runs of the float32 model and stray from it about as far: each op of
    # ours rounds once where torch's round twice, but 30 layers of rounding then wander either
    # way (measured at avx2: ours 0.161, torch 0.132; our kernels with torch's elementwise
    # ops 0.118). A wrong kernel strays by whole units.
    ours_error = (ours_logits - expected).abs().mean()
    plain_error = (plain_logits - expected).abs().mean()
    print(f"mean error against float32: ours {ours_error:.4f}, torch {plain_error:.4f}")
    assert ours_error < 1.5 * plain_error
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() > 10
    assert torch.equal(ours_logits.argmax(-1)[clear], expected.argmax(-1)[clear])


def test_which_kernel_each_level_uses() -> None:
    # float32: the FMA kernel at every level with AVX2 (measured faster than MKL on AVX2 and
    # AVX-512 CPUs); bfloat16: the FMA kernel without native bf16, VDPBF16PS with it, AMX
    # tiles at amx. Only built and loaded here, never run, so any CPU can check the rule.
    from worker_svc.kernels import load_cpu_kernels
    from worker_svc.kernels.gemm import gemm_kernel

    assert gemm_kernel(CpuLevel.NONE, torch.bfloat16) is None
    for level in (CpuLevel.AVX2, CpuLevel.AVX512, CpuLevel.AVX512_BF16, CpuLevel.AMX):
        assert isinstance(gemm_kernel(level, torch.float32), FmaGemm)
        bf16 = gemm_kernel(level, torch.bfloat16)
        assert isinstance(bf16, Bf16Gemm if level.native_bf16 else FmaGemm)
    if detect_level() >= CpuLevel.AMX:      # the tiles need this process's grant to load
        assert isinstance(load_cpu_kernels(CpuLevel.AMX, 64, 3, torch.bfloat16).gemm,
                          AmxGemm)


def _blocks(bits: int, n: int, k: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    """Random blocks and the float32 weight they stand for (gguf's dequantization)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    if bits == 4:
        values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        offsets = -torch.rand(n, groups, generator=g) * 0.1
    else:
        values = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
        offsets = torch.zeros(n, groups)
    scales = torch.rand(n, groups, generator=g) * 0.02
    weight = (scales.repeat_interleave(32, 1) * values.float()
              + offsets.repeat_interleave(32, 1))
    return QuantBlocks(values, scales, offsets, bits), weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])      # passes of 4 rows, and remainders
@pytest.mark.parametrize("n,k", [(3, 32), (96, 576), (50, 1536)])
def test_quant_kernel_matches_float32_matmul(kernel_level: CpuLevel, dtype: torch.dtype,
                                             bits: int, m: int, n: int, k: int) -> None:
    kernel = quant_gemm(kernel_level, dtype, bits)
    assert kernel is not None, "gemm_quant.c did not build (see the log)"
    blocks, weight = _blocks(bits, n, k, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = kernel(x, kernel.pack(blocks))
    assert out.dtype == dtype and out.shape == (m, n)
    _close_to_float32(out, x, weight)


def test_quant_kernel_same_result_on_any_thread_count(kernel_level: CpuLevel) -> None:
    kernel = quant_gemm(kernel_level, torch.float32, 4)
    assert kernel is not None
    blocks, _ = _blocks(4, 960, 576, 3)
    packed = kernel.pack(blocks)
    x = torch.randn(5, 576)
    assert torch.equal(on_threads(1, kernel, x, packed), kernel(x, packed))
    with pytest.raises(ValueError, match="cannot pack"):
        kernel.pack(_blocks(8, 4, 32, 0)[0])                     # 8-bit blocks, 4-bit kernel


@pytest.mark.skipif(detect_level() < CpuLevel.AVX512_BF16,
                    reason="torch's int4 kernel serves level avx512_bf16 only")
def test_torch_int4_at_the_bf16_level() -> None:
    kernel = quant_kernels(CpuLevel.AVX512_BF16, torch.bfloat16)[4]
    assert isinstance(kernel, TorchInt4)
    blocks, weight = _blocks(4, 96, 576, 1)
    x = torch.randn(3, 576).bfloat16()
    torch.testing.assert_close(kernel(x, kernel.pack(blocks)).float(), x.float() @ weight.T,
                               rtol=2e-2, atol=5e-2)
