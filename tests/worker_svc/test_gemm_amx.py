"""gemm_amx.c (AmxGemm) against float32 matmul: row counts around its 16-row tiles, SmolLM2's
shapes, k not a multiple of 32, thread-count independence, the weights it refuses; its
quantized-block entry (AmxBlocksGemm) against AmxGemm on the same weights dequantized, bit for
bit. The build check runs on any machine; the rest needs AMX."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.worker_svc.common import on_threads
from worker_svc.kernels import build
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.gemm_amx import AmxGemm, amx_blocks_gemm, amx_gemm, pack_blocks
from worker_svc.kernels.quant_blocks import QuantBlocks

needs_amx = pytest.mark.skipif(detect_level() < CpuLevel.AMX,
                               reason="gemm_amx.c runs on CPUs with AMX tiles only")


@pytest.fixture(scope="module")
def gemm() -> AmxGemm:
    kernel = amx_gemm(CpuLevel.AMX)
    assert kernel is not None, "gemm_amx.c did not build (see the log)"
    return kernel


def _close_to_float32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # float32 sums in another order, then one bfloat16 rounding (relative 2^-8)
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], w.shape[0])
    torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2 ** -8, atol=1e-2)


def _random(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 100_000 + n * 10 + k)
    return (torch.randn(m, k, generator=gen).bfloat16(),
            torch.randn(n, k, generator=gen).bfloat16())


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler: the kernels fall back to torch")
def test_builds_at_level_amx_only(tmp_path: Path) -> None:
    # Built, not loaded: any x86 machine's GCC checks the code.
    build.compile_only("gemm_amx.c", CpuLevel.AMX, {}, tmp_path / "amx.so")
    assert (tmp_path / "amx.so").stat().st_size > 0
    with pytest.raises(RuntimeError, match="need AMX-TILE and AMX-BF16"):
        build.compile_only("gemm_amx.c", CpuLevel.AVX512_BF16, {}, tmp_path / "x.so")
    assert amx_gemm(CpuLevel.AVX512_BF16) is None


# m: one row, partial tiles under 16, exactly one tile, a tile and one row (the last tile
# overlaps), odd pairs of tiles, and past the 256-row chunk.
@needs_amx
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 100, 128, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 40)])
def test_matches_float32_matmul(gemm: AmxGemm, m: int, n: int, k: int) -> None:
    x, w = _random(m, n, k)
    _close_to_float32(gemm(x, gemm.pack(w)), x, w)


@needs_amx
@pytest.mark.parametrize("m,n,k", [(17, 3072, 576), (8, 576, 576), (3, 8192, 576),
                                   (40, 32, 72), (2, 96, 1), (20, 32, 33)])
def test_other_shapes(gemm: AmxGemm, m: int, n: int, k: int) -> None:
    # gate_up, o, a slice of the LM head's 49152 columns; k = 72, 1, 33: padded with zeros
    x, w = _random(m, n, k)
    _close_to_float32(gemm(x, gemm.pack(w)), x, w)


@needs_amx
def test_rounds_once_to_nearest_even_as_torch(gemm: AmxGemm) -> None:
    # Small integers: every sum is exact in float32, so the only rounding is the final one,
    # which must be torch's.
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 9, (37, 96), generator=gen).bfloat16()
    w = torch.randint(-8, 9, (64, 96), generator=gen).bfloat16()
    assert torch.equal(gemm(x, gemm.pack(w)), (x.float() @ w.float().T).bfloat16())


@needs_amx
def test_same_result_on_any_thread_count(gemm: AmxGemm) -> None:
    x, w = _random(100, 960, 576)
    packed = gemm.pack(w)
    assert torch.equal(on_threads(1, gemm, x, packed), on_threads(2, gemm, x, packed))


@needs_amx
def test_refuses_what_it_does_not_take(gemm: AmxGemm) -> None:
    assert not gemm.fits(torch.zeros(48, 64, dtype=torch.bfloat16))    # n not a multiple of 32
    assert not gemm.fits(torch.zeros(32, 64))                          # float32
    assert not gemm.fits(torch.zeros(32, 0, dtype=torch.bfloat16))     # nothing to multiply
    assert not gemm.fits(torch.zeros(32, dtype=torch.bfloat16))        # not a matrix
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    packed = gemm.pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected contiguous"):
        gemm(torch.zeros(4, 62, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="expected contiguous"):
        gemm(torch.zeros(64, 4, dtype=torch.bfloat16).T, packed)
    assert gemm(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


def test_refuses_to_exist_without_the_tile_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # No library is touched: the refusal comes first, so any machine checks it.
    from worker_svc.kernels import gemm_amx

    monkeypatch.setattr(gemm_amx, "request_amx", lambda: "Linux refused (test)")
    with pytest.raises(RuntimeError, match="no AMX tiles for this process: Linux refused"):
        AmxGemm(None)  # type: ignore[arg-type]


# ---- gemm_amx_blocks: bfloat16 on quantized blocks, dequantized panel by panel in cache


def _blocks(n: int, k: int, bits: int, kind: str, seed: int) -> QuantBlocks:
    """Q4_1-like (offsets free), Q4_0-like (offsets -8 scales) or Q8_0-like blocks, with
    float16 scales as a GGUF's."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // 32
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()
    if bits == 8:
        return QuantBlocks(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen),
                           scales, torch.zeros(n, groups), 8)
    offsets = (-8 * scales if kind == "q4_0"
               else -(torch.rand(n, groups, generator=gen) * 0.1).half().float())
    return QuantBlocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen), scales,
                       offsets, 4)


def _dense_bf16(b: QuantBlocks) -> torch.Tensor:
    # the weights loader's float32 formula, then the model's cast
    return (b.scales.repeat_interleave(32, 1) * b.values.float()
            + b.offsets.repeat_interleave(32, 1)).bfloat16()


@needs_amx
@pytest.mark.parametrize("bits,kind", [(4, "q4_1"), (4, "q4_0"), (8, "q8_0")])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 100, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 32)])
def test_blocks_equal_the_dense_kernel_bit_for_bit(gemm: AmxGemm, bits: int, kind: str, m: int,
                                                   n: int, k: int) -> None:
    blocks_kernel = amx_blocks_gemm(CpuLevel.AMX, bits)
    assert blocks_kernel is not None
    b = _blocks(n, k, bits, kind, seed=m + n + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    out = blocks_kernel(x, blocks_kernel.pack(b))
    assert torch.equal(out, gemm(x, gemm.pack(_dense_bf16(b))))
    _close_to_float32(out, x, _dense_bf16(b))


@needs_amx
def test_blocks_same_result_on_any_thread_count() -> None:
    kernel = amx_blocks_gemm(CpuLevel.AMX, 4)
    assert kernel is not None
    packed = kernel.pack(_blocks(960, 576, 4, "q4_1", seed=1))
    x = torch.randn(100, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(on_threads(1, kernel, x, packed), on_threads(2, kernel, x, packed))


@needs_amx
def test_blocks_refuse_what_they_do_not_take() -> None:
    kernel = amx_blocks_gemm(CpuLevel.AMX, 4)
    assert kernel is not None
    assert kernel.fits(_blocks(64, 64, 4, "q4_1", seed=0))
    assert not kernel.fits(_blocks(64, 64, 8, "q8_0", seed=0))       # other bits
    assert not kernel.fits(_blocks(48, 64, 4, "q4_1", seed=0))       # n not a multiple of 32
    odd = _blocks(64, 64, 4, "q4_1", seed=0)
    odd = QuantBlocks(odd.values, odd.scales + 1e-9, odd.offsets, 4)  # not float16
    assert not kernel.fits(odd)
    with pytest.raises(ValueError, match="cannot pack"):
        kernel.pack(odd)


@pytest.mark.parametrize("bits,kind", [(4, "q4_1"), (8, "q8_0")])
def test_blocks_layout_holds_every_weight_where_the_kernel_reads_it(bits: int, kind: str
                                                                    ) -> None:
    # Any machine: reads the packed blocks as gemm_amx_blocks does (per panel, step, tile half
    # and row: 32 values, 4-bit rows as low nibbles then high; scales per panel and step) and
    # rebuilds the dense weight.
    n, k = 96, 128
    b = _blocks(n, k, bits, kind, seed=7)
    packed = pack_blocks(b)
    panels, steps = n // 32, k // 32
    raw = packed.values.view(panels, steps, 2, 16, -1)
    if bits == 4:
        rows = torch.cat([raw & 0x0F, raw >> 4], dim=-1).float()
    else:
        rows = raw.view(torch.int8).float()
    rows = rows.view(panels, steps, 2, 16, 16, 2)                  # [p][s][h][i][j][t]
    scales = packed.scales.float().view(panels, steps, 2, 1, 16, 1)
    offsets = (torch.zeros_like(scales) if packed.offsets is None
               else packed.offsets.float().view(panels, steps, 2, 1, 16, 1))
    w = (rows * scales + offsets).permute(0, 2, 4, 1, 3, 5).reshape(n, k)
    assert torch.equal(w.bfloat16(), _dense_bf16(b))
    assert (packed.offsets is None) == (bits == 8)
