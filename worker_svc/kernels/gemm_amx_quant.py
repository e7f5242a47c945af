"""`gemm_amx_quant.c`: y = x @ w.T in float32 on a GGUF's quantized blocks (Q4_0, Q4_1, Q8_0),
on AMX tiles with every product exact (the activations split into three bfloat16 parts; see
the C file). At level amx it takes the float32 steps of more rows than the small-step kernel
(`gemm.QuantGemm`) does, so a quantized weight needs no dense float32 copy there.

Measured against `gemm_fma.c` on the dense float32 weight (`bench/amx_gemm.py --dtype
float32`, 2 threads of a Xeon family 6 model 207 with AMX, SmolLM2's shapes, 30 distinct
weights from memory, medians of 3 rounds): 1.2-1.9x at 64 and 128 rows, 1.2-1.5x at 2,816 (a
prefill step). The tile products run at a third of the bfloat16 kernel's speed (three parts
each), and the per-block fold of scales and offsets takes about a quarter of the time.

The tiles are process state Linux grants on request, so the constructor asks
(`cpu.request_amx`) and refuses to exist without it.
"""

import ctypes
from dataclasses import dataclass

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel, request_amx
from worker_svc.kernels.gemm import PackedQuant, QuantGemm, _check_rows
from worker_svc.kernels.quant_blocks import QUANT_BLOCK, QuantBlocks

_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class PackedQuantTiles:
    """Quantized blocks in `gemm_amx_quant.c`'s layout: the values as exact bfloat16 tiles,
    scales and offsets per panel of 32 output columns."""

    values: torch.Tensor    # [n * k] bfloat16
    scales: torch.Tensor    # [n * k / 32] float32
    offsets: torch.Tensor | None  # same; None where every offset is 0 (Q8_0)
    out_features: int
    in_features: int


class AmxQuantGemm:
    """`gemm_amx_quant.c`: x @ w.T, float32 activations on quantized blocks, any row count."""

    __slots__ = ("lib",)
    PANEL = 32   # output columns per packed panel (NR in the C file)
    max_rows: int | None = None

    def __init__(self, library: ctypes.CDLL):
        reason = request_amx()
        if reason is not None:
            raise RuntimeError(f"gemm_amx_quant: no AMX tiles for this process: {reason}")
        self.lib = library
        library.pack_values.restype = None
        library.pack_values.argtypes = [_P, ctypes.c_int, _P, _I, _I]
        library.pack_block_floats.restype = None
        library.pack_block_floats.argtypes = [_P, _P, _I, _I]
        library.gemm_amx_quant.restype = None
        library.gemm_amx_quant.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I]

    def fits(self, blocks: QuantBlocks) -> bool:
        n, k = blocks.values.shape
        return (blocks.bits in (4, 8) and n > 0 and k > 0 and n % self.PANEL == 0
                and k % QUANT_BLOCK == 0)

    def _floats(self, table: torch.Tensor, n: int, blocks: int) -> torch.Tensor:
        src = table.float().contiguous()
        packed = torch.empty(n * blocks, dtype=torch.float32)
        self.lib.pack_block_floats(src.data_ptr(), packed.data_ptr(), n, blocks)
        return packed

    def pack(self, blocks: QuantBlocks) -> PackedQuantTiles:
        if not self.fits(blocks):
            raise ValueError(f"gemm_amx_quant: cannot pack {blocks.bits}-bit blocks of shape "
                             f"{tuple(blocks.values.shape)} (takes 4 or 8 bits, n a multiple "
                             f"of {self.PANEL}, k of {QUANT_BLOCK})")
        n, k = blocks.values.shape
        q = blocks.values.contiguous()
        values = torch.empty(n * k, dtype=torch.bfloat16)
        self.lib.pack_values(q.data_ptr(), blocks.bits, values.data_ptr(), n, k)
        offsets = None if not blocks.offsets.any() else self._floats(blocks.offsets, n,
                                                                     k // QUANT_BLOCK)
        return PackedQuantTiles(values, self._floats(blocks.scales, n, k // QUANT_BLOCK),
                                offsets, n, k)

    def __call__(self, x: torch.Tensor, w: PackedQuantTiles) -> torch.Tensor:
        """x [m, k] contiguous float32 -> [m, n] float32."""
        _check_rows(x, torch.float32, w.in_features)
        out = x.new_empty(x.shape[0], w.out_features)
        if x.shape[0]:
            self.lib.gemm_amx_quant(
                x.data_ptr(), w.values.data_ptr(), w.scales.data_ptr(),
                None if w.offsets is None else w.offsets.data_ptr(), out.data_ptr(),
                x.shape[0], w.out_features, w.in_features)
        return out


@dataclass(frozen=True, slots=True)
class TieredPack:
    small: PackedQuant
    large: PackedQuantTiles


class TieredQuant:
    """Quantized blocks at every row count: `small` (gemm_quant.c) up to SMALL_ROWS rows, the
    AMX kernel beyond. The model then keeps no dense copy of such a weight."""

    __slots__ = ("small", "large", "bits", "small_rows")
    max_rows: int | None = None
    # The AMX kernel against gemm_quant.c (/tmp script, the machine above, SmolLM2's shapes, 30
    # weights from memory, medians of 5): 0.5-0.6x at 1 row, 0.6-0.8x at 2, 0.96-1.08x at 4
    # (1.35x on the LM head), 1.4-1.7x at 8, 2.1-2.6x at 16.
    SMALL_ROWS = 3

    def __init__(self, small: QuantGemm, large: AmxQuantGemm):
        self.small, self.large, self.bits = small, large, small.bits
        self.small_rows = min(small.max_rows, self.SMALL_ROWS)

    def fits(self, blocks: QuantBlocks) -> bool:
        return self.small.fits(blocks) and self.large.fits(blocks)

    def pack(self, blocks: QuantBlocks) -> TieredPack:
        return TieredPack(self.small.pack(blocks), self.large.pack(blocks))

    def __call__(self, x: torch.Tensor, w: TieredPack) -> torch.Tensor:
        if x.shape[0] <= self.small_rows:
            return self.small(x, w.small)
        return self.large(x, w.large)


def amx_quant_gemm(level: CpuLevel) -> AmxQuantGemm | None:
    """`gemm_amx_quant.c`, at level amx only (None below it, or where it does not build)."""
    library = build("gemm_amx_quant.c", level, {}) if level >= CpuLevel.AMX else None
    return None if library is None else AmxQuantGemm(library)
