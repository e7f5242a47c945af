"""`gemm_amx.c`: y = x @ w.T in bfloat16 on AMX tiles (TDPBF16PS), with the weight packed once
at load into the kernel's tile layout. Same interface as `gemm.Bf16Gemm`; the model's Linear
picks between it, `Bf16Gemm` and oneDNN by row count (`max_rows`).

The tiles are process state Linux grants on request, so the constructor asks
(`cpu.request_amx`) and refuses to exist without it: a tile instruction without the grant
kills the process with SIGILL.
"""

import ctypes
from dataclasses import dataclass

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel, request_amx
from worker_svc.kernels.gemm import PackedWeight, _check_rows
from worker_svc.kernels.quant_blocks import QUANT_BLOCK, QuantBlocks

_P, _I = ctypes.c_void_p, ctypes.c_int64


class AmxGemm:
    """`gemm_amx.c`: x @ w.T in bfloat16 (bf16 products, float32 sums in the tiles)."""

    __slots__ = ("lib",)
    PANEL = 32   # output columns per packed panel (NR in gemm_amx.c)
    # Against oneDNN's AMX matmul on pre-packed weights (bench/amx_gemm.py, 2 Emerald Rapids
    # cores, weights from memory, a shared noisy machine): 1.2-2.4x from 1 to 32 rows on every
    # SmolLM2 shape; 1.1-1.2x at 64 and 128 rows on qkv, gate_up and down, even or behind on o
    # and the LM head there (0.7-1.0x in noisy rounds); equal to gemm_bf16.c at one row (both
    # stream the weight at memory speed). From 256 rows oneDNN is as fast or faster.
    max_rows: int | None = 128

    def __init__(self, library: ctypes.CDLL):
        reason = request_amx()
        if reason is not None:
            raise RuntimeError(f"gemm_amx: no AMX tiles for this process: {reason}")
        self.lib = library
        library.packed_size.restype = ctypes.c_int64
        library.packed_size.argtypes = [_I, _I]
        library.pack_weight.restype = None
        library.pack_weight.argtypes = [_P, _P, _I, _I]
        library.gemm_amx.restype = None
        library.gemm_amx.argtypes = [_P, _P, _P, _I, _I, _I]

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether `pack` takes this [n, k] weight: bfloat16, n a multiple of PANEL, any k
        (padded to a multiple of 32 with zeros), neither empty."""
        return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.numel() > 0
                and weight.shape[0] % self.PANEL == 0)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        if not self.fits(weight):
            raise ValueError(f"gemm_amx: cannot pack {weight.dtype} {tuple(weight.shape)} "
                             f"(takes bfloat16 [n, k] with n a multiple of {self.PANEL})")
        weight = weight.contiguous()
        n, k = weight.shape
        packed = torch.empty(self.lib.packed_size(n, k), dtype=torch.bfloat16)
        self.lib.pack_weight(weight.data_ptr(), packed.data_ptr(), n, k)
        return PackedWeight(packed, n, k)

    def __call__(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        """x [m, k] contiguous bfloat16 -> [m, n]."""
        _check_rows(x, torch.bfloat16, w.in_features)
        out = x.new_empty(x.shape[0], w.out_features)
        if x.shape[0]:
            self.lib.gemm_amx(x.data_ptr(), w.data.data_ptr(), out.data_ptr(), x.shape[0],
                              w.out_features, w.in_features)
        return out


def amx_gemm(level: CpuLevel) -> AmxGemm | None:
    """`gemm_amx.c`, at level amx only (None below it, or where it does not build)."""
    library = build("gemm_amx.c", level, {}) if level >= CpuLevel.AMX else None
    return None if library is None else AmxGemm(library)


@dataclass(frozen=True, slots=True)
class PackedBlocks:
    """Quantized blocks in `gemm_amx_blocks`' layout (see gemm_amx.c)."""

    values: torch.Tensor          # per panel, step, tile half and row: 32 values (bytes)
    scales: torch.Tensor          # [n / 32, k / 32, 32] float16
    offsets: torch.Tensor | None  # same; None where every offset is 0 (Q8_0)
    bits: int
    out_features: int
    in_features: int


class AmxBlocksGemm:
    """`gemm_amx_blocks` (gemm_amx.c): x @ w.T in bfloat16 on a GGUF's Q4_0/Q4_1/Q8_0 blocks,
    each panel dequantized to bfloat16 in cache just before its tile products. The result is
    `AmxGemm`'s on the dense bfloat16 weight (bfloat16(scale * q + offset)), bit for bit, and
    a step reads 0.625 bytes a weight (Q4_1) or 1.06 (Q8_0) instead of 2.

    Not used by the model yet: written on a machine without AMX, so neither run nor measured.
    Its tests (tests/worker_svc/test_gemm_amx.py, bit for bit against AmxGemm) and
    `bench/amx_gemm.py --dtype blocks` decide on an AMX machine whether the model's bfloat16
    steps up to `max_rows` take it (it would replace AmxGemm's dense copy there)."""

    __slots__ = ("lib", "bits")
    PANEL = 32
    max_rows: int | None = 128    # as AmxGemm: oneDNN's blocking wins beyond

    def __init__(self, library: ctypes.CDLL, bits: int):
        reason = request_amx()
        if reason is not None:
            raise RuntimeError(f"gemm_amx: no AMX tiles for this process: {reason}")
        self.lib, self.bits = library, bits
        library.gemm_amx_blocks.restype = None
        library.gemm_amx_blocks.argtypes = [_P, _P, ctypes.c_int, _P, _P, _P, _I, _I, _I]

    def fits(self, blocks: QuantBlocks) -> bool:
        """4 or 8 bits, n a multiple of PANEL, k of 32, scales and offsets exact in float16
        (a GGUF's are float16; Q4_0's offsets are -8 scales)."""
        n, k = blocks.values.shape
        return (blocks.bits == self.bits and n > 0 and k > 0 and n % self.PANEL == 0
                and k % QUANT_BLOCK == 0 and _exact_half(blocks.scales)
                and _exact_half(blocks.offsets))

    def pack(self, blocks: QuantBlocks) -> PackedBlocks:
        if not self.fits(blocks):
            raise ValueError(f"gemm_amx_blocks: cannot pack {blocks.bits}-bit blocks of shape "
                             f"{tuple(blocks.values.shape)} (takes {self.bits} bits, n a "
                             f"multiple of {self.PANEL}, k of {QUANT_BLOCK}, float16 scales)")
        return pack_blocks(blocks)

    def __call__(self, x: torch.Tensor, w: PackedBlocks) -> torch.Tensor:
        """x [m, k] contiguous bfloat16 -> [m, n]."""
        _check_rows(x, torch.bfloat16, w.in_features)
        out = x.new_empty(x.shape[0], w.out_features)
        if x.shape[0]:
            self.lib.gemm_amx_blocks(
                x.data_ptr(), w.values.data_ptr(), w.bits, w.scales.data_ptr(),
                None if w.offsets is None else w.offsets.data_ptr(), out.data_ptr(),
                x.shape[0], w.out_features, w.in_features)
        return out


def pack_blocks(blocks: QuantBlocks) -> PackedBlocks:
    """Blocks -> `gemm_amx_blocks`' layout (gemm_amx.c), in torch; the caller checked `fits`."""
    n, k = blocks.values.shape
    panels, steps = n // AmxBlocksGemm.PANEL, k // QUANT_BLOCK
    # q[p * 32 + h * 16 + j, s * 32 + 2 i + t] -> [p][s][h][i][j][t]: a tile row's 32 values
    q = (blocks.values.view(torch.uint8).reshape(panels, 2, 16, steps, 16, 2)
         .permute(0, 3, 1, 4, 2, 5).reshape(-1, 32))
    if blocks.bits == 4:
        q = q[:, :16] | (q[:, 16:] << 4)    # byte b: value b low, value b + 16 high

    def per_panel(table: torch.Tensor) -> torch.Tensor:     # [n, steps] -> [p][s][32]
        return table.half().reshape(panels, AmxBlocksGemm.PANEL, steps).transpose(1, 2) \
            .contiguous()
    offsets = per_panel(blocks.offsets) if blocks.offsets.any() else None
    return PackedBlocks(q.contiguous().reshape(-1), per_panel(blocks.scales), offsets,
                        blocks.bits, n, k)


def _exact_half(table: torch.Tensor) -> bool:
    return bool((table.half().float() == table).all())


def amx_blocks_gemm(level: CpuLevel, bits: int) -> AmxBlocksGemm | None:
    """`gemm_amx_blocks` on `bits`-bit blocks, at level amx only."""
    library = build("gemm_amx.c", level, {}) if level >= CpuLevel.AMX else None
    return None if library is None else AmxBlocksGemm(library, bits)
