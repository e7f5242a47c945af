"""gemm_amx_quant.c (AmxQuantGemm): float32 on quantized blocks on AMX tiles. Its products are
exact (an identity weight gives x back bit for bit), it agrees with the small-step kernel on
the same blocks (the same factoring) and with a float64 reference to float32 precision, at
row counts around its tiles, in any thread count; and at level amx in float32 a quantized
weight takes it for every step past the small-step kernel's rows and keeps no dense copy. The
build check runs on any machine; the rest needs AMX."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.worker_svc.common import on_threads
from worker_svc.kernels import QuantBlocks, TieredQuant, build, load_cpu_kernels
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.gemm import quant_gemm
from worker_svc.kernels.gemm_amx_quant import AmxQuantGemm, amx_quant_gemm

needs_amx = pytest.mark.skipif(detect_level() < CpuLevel.AMX,
                               reason="gemm_amx_quant.c runs on CPUs with AMX tiles only")


@pytest.fixture(scope="module")
def gemm() -> AmxQuantGemm:
    kernel = amx_quant_gemm(CpuLevel.AMX)
    assert kernel is not None, "gemm_amx_quant.c did not build (see the log)"
    return kernel


def _blocks(n: int, k: int, bits: int, seed: int = 0) -> QuantBlocks:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        values = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        offsets = -(torch.rand(n, k // 32, generator=gen) * 0.1).half().float()
    else:
        values = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        offsets = torch.zeros(n, k // 32)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    return QuantBlocks(values, scales, offsets, bits)


def _dense(blocks: QuantBlocks) -> torch.Tensor:
    """The weight gguf's dequantization gives, in float64."""
    expand = lambda t: t.double().repeat_interleave(32, dim=1)  # noqa: E731
    return expand(blocks.scales) * blocks.values.double() + expand(blocks.offsets)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the kernels fall back to torch")
def test_builds_at_level_amx_only(tmp_path: Path) -> None:
    build.compile_only("gemm_amx_quant.c", CpuLevel.AMX, {}, tmp_path / "q.so")
    assert (tmp_path / "q.so").stat().st_size > 0
    with pytest.raises(RuntimeError, match="need AMX-TILE and AMX-BF16"):
        build.compile_only("gemm_amx_quant.c", CpuLevel.AVX512_BF16, {}, tmp_path / "x.so")
    assert amx_quant_gemm(CpuLevel.AVX512_BF16) is None


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 17, 64])
def test_products_are_exact(gemm: AmxQuantGemm, bits: int, m: int) -> None:
    # w = identity (scale 1, q one-hot): each output is one input times 1 plus exact zeros,
    # so any bit of x lost in its bfloat16 parts shows. x spans 2^-60..2^60.
    n = k = 64
    values = torch.eye(n, k, dtype=torch.uint8 if bits == 4 else torch.int8)
    blocks = QuantBlocks(values, torch.ones(n, k // 32), torch.zeros(n, k // 32), bits)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * 2.0 ** torch.randint(-60, 60, (m, k), generator=gen)
    assert torch.equal(gemm(x, gemm.pack(blocks)), x)


# m: one row, partial tiles under 16, one tile, a tile and one row, odd tiles, past the
# 128-row chunk; the LM head's Q8_0 and the layers' Q4_1 shapes.
@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 100, 300])
@pytest.mark.parametrize("n,k,bits", [(960, 576, 4), (576, 1536, 4), (96, 576, 8)])
def test_matches_float64_to_float32_precision(gemm: AmxQuantGemm, m: int, n: int, k: int,
                                              bits: int) -> None:
    blocks = _blocks(n, k, bits, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    ours = gemm(x, gemm.pack(blocks))
    w = _dense(blocks)
    reference = x.double() @ w.T
    # float32 sums of k terms: within k * 2^-24 of the sum of |terms| (a bfloat16 part
    # dropped would be ~2^-16 of the terms, rounding to bfloat16 ~2^-8)
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    assert ((ours.double() - reference).abs() <= bound).all()
    assert (ours.double() - reference).abs().max() < 1e-3 * reference.abs().max()
    # the small-step kernel's factoring, float32 sums in another order
    small = quant_gemm(CpuLevel.AVX2, torch.float32, bits)
    assert small is not None
    torch.testing.assert_close(ours, small(x, small.pack(blocks)), rtol=0,
                               atol=float(bound.max()))


@needs_amx
def test_results_do_not_depend_on_the_thread_count(gemm: AmxQuantGemm) -> None:
    blocks = _blocks(3072, 576, 4)
    packed = gemm.pack(blocks)
    x = torch.randn(100, 576)
    assert torch.equal(on_threads(1, gemm, x, packed), on_threads(2, gemm, x, packed))


@needs_amx
def test_refuses_what_it_cannot_pack(gemm: AmxQuantGemm) -> None:
    odd_k = QuantBlocks(torch.zeros(64, 48, dtype=torch.uint8), torch.ones(64, 1),
                        torch.zeros(64, 1), 4)
    for blocks in (_blocks(48, 576, 4), odd_k):       # n not a multiple of 32; k of 32
        assert not gemm.fits(blocks)
        with pytest.raises(ValueError, match="cannot pack"):
            gemm.pack(blocks)
    with pytest.raises(ValueError, match="float32"):
        gemm(torch.randn(4, 576).bfloat16(), gemm.pack(_blocks(32, 576, 4)))


@needs_amx
def test_float32_at_amx_runs_every_step_on_the_blocks() -> None:
    from worker_svc.model.llama import Linear

    kernels = load_cpu_kernels(CpuLevel.AMX, 64, 3, torch.float32)
    assert set(kernels.quant) == {4, 8}
    assert all(isinstance(q, TieredQuant) for q in kernels.quant.values())
    blocks = _blocks(96, 576, 4)
    linear = Linear([_dense(blocks).float()], [blocks], kernels)
    assert linear.weight is None and linear.gemm is None and linear.onednn is None
    tiered = linear.quant
    assert isinstance(tiered, TieredQuant)
    for m in (1, tiered.small_rows, tiered.small_rows + 1, 64):
        x = torch.randn(m, 576)
        kernel, packed = ((tiered.small, linear.quant_weight.small) if m <= tiered.small_rows
                          else (tiered.large, linear.quant_weight.large))
        assert torch.equal(linear(x), kernel(x, packed))
    # a shape the tiles do not take (n not a multiple of 32) keeps the small steps on its blocks
    odd = _blocks(48, 576, 4)
    linear = Linear([_dense(odd).float()], [odd], kernels)
    assert linear.quant is tiered.small and linear.quant_max_rows == tiered.small.max_rows
    x = torch.randn(20, 576)
    torch.testing.assert_close(linear(x), x @ _dense(odd).float().T, rtol=1e-5, atol=1e-4)
    # bfloat16 at amx keeps its dense tiles (the small steps on torch's int4 kernel)
    assert not any(isinstance(q, TieredQuant)
                   for q in load_cpu_kernels(CpuLevel.AMX, 64, 3, torch.bfloat16).quant.values())
