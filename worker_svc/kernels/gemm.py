"""The matmul kernels: y = x @ w.T with a weight packed once at load.

- `gemm_bf16.c` (levels avx512_bf16 and amx): bfloat16 with VDPBF16PS, for small steps (up
  to `Bf16Gemm.max_rows`, which depends on the level); oneDNN does larger ones (on AMX tiles
  at level amx). It prefetches the next weight panel while
  it multiplies the current one, which oneDNN leaves exposed at those sizes.
- `gemm_fma.c` (levels avx2 and avx512): float32 FMA for bfloat16 or float32 weights, any
  batch size; how bfloat16 runs on a CPU without a bfloat16 dot product, and float32's
  matmul at level avx2 (faster than MKL's sgemm there at every size, measured).
- `gemm_quant.c` (any level with AVX2): steps of a few rows straight on a GGUF's Q4_0, Q4_1
  or Q8_0 blocks, a fifth of float32's bytes (single-stream decode reads every weight once).

Each takes the weight its own `pack` made (each has its own layout).
"""

import ctypes
from dataclasses import dataclass

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel
from worker_svc.kernels.quant_blocks import QUANT_BLOCK, QuantBlocks

_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight in one kernel's layout."""

    data: torch.Tensor     # the kernel's layout (not a matrix)
    out_features: int      # n
    in_features: int       # k


class Bf16Gemm:
    """`gemm_bf16.c`: x @ w.T in bfloat16 (bf16 products, float32 sums) with VDPBF16PS."""

    __slots__ = ("lib", "max_rows")
    PANEL = 48   # output columns per packed panel (NR in gemm_bf16.c)

    def __init__(self, library: ctypes.CDLL, max_rows: int):
        self.lib = library
        # The rows it takes; oneDNN does larger steps (worker_svc.model.linear.Linear).
        self.max_rows: int | None = max_rows
        library.pack_weight.restype = None
        library.pack_weight.argtypes = [_P, _P, _I, _I]
        library.gemm_bf16.restype = None
        library.gemm_bf16.argtypes = [_P, _P, _P, _I, _I, _I]

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether `pack` takes this [n, k] weight: bfloat16, n a multiple of PANEL, k even,
        neither empty."""
        return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.numel() > 0
                and weight.shape[0] % self.PANEL == 0 and weight.shape[1] % 2 == 0)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        if not self.fits(weight):
            raise ValueError(f"gemm_bf16: cannot pack {weight.dtype} {tuple(weight.shape)}")
        weight = weight.contiguous()
        packed = torch.empty_like(weight)
        self.lib.pack_weight(weight.data_ptr(), packed.data_ptr(), *weight.shape)
        return PackedWeight(packed, *weight.shape)

    def __call__(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        """x [m, k] contiguous bfloat16 -> [m, n]."""
        _check_rows(x, torch.bfloat16, w.in_features)
        out = x.new_empty(x.shape[0], w.out_features)
        self.lib.gemm_bf16(x.data_ptr(), w.data.data_ptr(), out.data_ptr(), x.shape[0],
                           w.out_features, w.in_features)
        return out


class FmaGemm:
    """`gemm_fma.c` for one (activation dtype, weight dtype): float32 products and sums."""

    __slots__ = ("lib", "dtype", "weight_dtype")
    max_rows: int | None = None   # any batch size

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype, weight_dtype: torch.dtype):
        self.lib, self.dtype, self.weight_dtype = library, dtype, weight_dtype
        library.packed_size.restype = ctypes.c_int64
        library.packed_size.argtypes = [_I, _I]
        library.pack_weight.restype = None
        library.pack_weight.argtypes = [_P, _P, _I, _I]
        library.gemm.restype = None
        library.gemm.argtypes = [_P, _P, _P, _I, _I, _I]

    def fits(self, weight: torch.Tensor) -> bool:
        return (weight.dim() == 2 and weight.dtype == self.weight_dtype
                and weight.numel() > 0)

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        if not self.fits(weight):
            raise ValueError(f"gemm_fma: cannot pack {weight.dtype} {tuple(weight.shape)} "
                             f"(takes {self.weight_dtype} matrices)")
        weight = weight.contiguous()
        n, k = weight.shape
        packed = torch.empty(self.lib.packed_size(n, k), dtype=weight.dtype)
        self.lib.pack_weight(weight.data_ptr(), packed.data_ptr(), n, k)
        return PackedWeight(packed, n, k)

    def __call__(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        """x [m, k] contiguous, in `dtype` -> [m, n]."""
        _check_rows(x, self.dtype, w.in_features)
        out = x.new_empty(x.shape[0], w.out_features)
        if x.shape[0]:
            self.lib.gemm(x.data_ptr(), w.data.data_ptr(), out.data_ptr(), x.shape[0],
                          w.out_features, w.in_features)
        return out


@dataclass(frozen=True, slots=True)
class PackedQuant:
    """Quantized blocks in `gemm_quant.c`'s layout."""

    values: torch.Tensor   # [n, k / 32, 16] uint8 (two 4-bit values a byte) or [n, k / 32, 32] int8
    scales: torch.Tensor   # [n, k / 32] float32
    offsets: torch.Tensor  # [n, k / 32] float32 (bits 8: not read)
    bits: int
    out_features: int
    in_features: int


class QuantGemm:
    """`gemm_quant.c` for one (activation dtype, bits): x @ w.T on quantized blocks, for steps
    of up to `max_rows` rows. Crossovers measured against the dense kernels on 2 Zen 2 cores
    (3072 x 576, weights from memory): float32 still 1.5x faster at 8 rows, bfloat16 about
    even at 4 (bfloat16's dense weights are half float32's bytes)."""

    __slots__ = ("lib", "dtype", "bits", "max_rows")

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype, bits: int):
        self.lib, self.dtype, self.bits = library, dtype, bits
        self.max_rows = 8 if dtype == torch.float32 else 4
        library.gemm_quant.restype = None
        library.gemm_quant.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I]

    def fits(self, blocks: QuantBlocks) -> bool:
        return blocks.bits == self.bits and blocks.values.shape[1] % QUANT_BLOCK == 0

    def pack(self, blocks: QuantBlocks) -> PackedQuant:
        if not self.fits(blocks):
            raise ValueError(f"gemm_quant: cannot pack {blocks.bits}-bit blocks of shape "
                             f"{tuple(blocks.values.shape)} (takes {self.bits}-bit, k % 32 == 0)")
        n, k = blocks.values.shape
        values = blocks.values.reshape(n, k // QUANT_BLOCK, QUANT_BLOCK)
        if self.bits == 4:  # ggml's order: byte i = value i | value i + 16 << 4
            values = values[..., :16] | (values[..., 16:] << 4)
        return PackedQuant(values.contiguous(), blocks.scales.float().contiguous(),
                           blocks.offsets.float().contiguous(), self.bits, n, k)

    def __call__(self, x: torch.Tensor, w: PackedQuant) -> torch.Tensor:
        """x [m, k] contiguous, in `dtype` -> [m, n]."""
        _check_rows(x, self.dtype, w.in_features)
        out = x.new_empty(x.shape[0], w.out_features)
        if x.shape[0]:
            self.lib.gemm_quant(x.data_ptr(), w.values.data_ptr(), w.scales.data_ptr(),
                                w.offsets.data_ptr(), out.data_ptr(), x.shape[0],
                                w.out_features, w.in_features)
        return out


class TorchInt4:
    """torch's int4 kernel on Q4 blocks, bfloat16 only: the small-step path from level
    avx512_bf16 up, where it was measured (single-stream decode 1.6x dense bf16). Its scales
    and offsets are bfloat16, so its weights equal the file's up to that rounding."""

    __slots__ = ("max_rows",)
    bits = 4

    def __init__(self, max_rows: int = 8):
        # Crossovers against dense bf16 on 2 cores, 30 layers' weights from memory: about 16
        # rows against gemm_bf16.c (AVX-512); about 4 against gemm_amx.c, whose tiles make
        # 8 rows cost little more than one (Xeon family 6 model 207).
        self.max_rows = max_rows

    def fits(self, blocks: QuantBlocks) -> bool:
        return blocks.bits == 4 and blocks.values.shape[1] % QUANT_BLOCK == 0

    def pack(self, blocks: QuantBlocks) -> PackedQuant:
        n, k = blocks.values.shape
        values = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.values.to(torch.int32), 1)
        # torch's form: w = (q - 8) * scale + zero
        zeros = blocks.offsets + 8 * blocks.scales
        scales_zeros = (torch.stack([blocks.scales, zeros], dim=-1).transpose(0, 1)
                        .contiguous().to(torch.bfloat16))     # [k / 32, n, 2]
        return PackedQuant(values, scales_zeros, scales_zeros, 4, n, k)

    def __call__(self, x: torch.Tensor, w: PackedQuant) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.values, QUANT_BLOCK, w.scales)


QuantKernel = QuantGemm | TorchInt4


def _check_rows(x: torch.Tensor, dtype: torch.dtype, k: int) -> None:
    if x.dtype != dtype or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"gemm: expected contiguous {dtype} [m, {k}], got {x.dtype} "
                         f"{tuple(x.shape)}")


Gemm = Bf16Gemm | FmaGemm


def gemm_kernel(level: CpuLevel, dtype: torch.dtype) -> Gemm | None:
    """The matmul kernel the model uses for `dtype` activations and weights at this level, or
    None (torch's matmul does them all)."""
    if dtype == torch.bfloat16 and level.native_bf16:
        return bf16_gemm(level)
    # float32: gemm_fma.c beats MKL's sgemm at every size measured, on AVX2 (Zen 2: 1.3-2x)
    # and AVX-512 (Xeon family 6 model 207, SmolLM2's shapes, 2 cores: 1.1-2.6x at 8 rows,
    # 1.25-1.65x at 64, 1.05-1.2x at 256, even at 2048).
    return fma_gemm(level, dtype)


def bf16_gemm(level: CpuLevel) -> Bf16Gemm | None:
    """`gemm_bf16.c`, from level avx512_bf16 up, for the rows where it beats oneDNN (on 2
    cores, SmolLM2's five weight shapes, 30 distinct weights each, measured):
    - avx512_bf16: up to 128 rows. It hides the weight stream that oneDNN leaves exposed (30
      layers at 64 rows: 35 against 42 ms); from there on oneDNN's blocking is as fast.
    - amx: up to 4 rows. oneDNN's AMX tiles win from about 6 rows on (1.1-1.6x at 8, 5-6x at
      64: 840-1140 against 170-175 GFLOP/s on a Xeon family 6 model 207); at 1-4 rows, where
      a step only streams the weights, this kernel's prefetch makes it 1.3-2.5x faster."""
    library = build("gemm_bf16.c", level, {}) if level.native_bf16 else None
    if library is None:
        return None
    return Bf16Gemm(library, 4 if level >= CpuLevel.AMX else 128)


def fma_gemm(level: CpuLevel, dtype: torch.dtype) -> FmaGemm | None:
    """`gemm_fma.c` for `dtype` activations and weights, at any level with AVX2."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    bf16 = int(dtype == torch.bfloat16)
    library = build("gemm_fma.c", level, {"ELEM_BF16": bf16, "W_BF16": bf16})
    return None if library is None else FmaGemm(library, dtype, dtype)


def quant_gemm(level: CpuLevel, dtype: torch.dtype, bits: int) -> QuantGemm | None:
    """`gemm_quant.c` for `dtype` activations on `bits`-bit blocks, at any level with AVX2."""
    if dtype not in (torch.bfloat16, torch.float32) or bits not in (4, 8):
        return None
    library = build("gemm_quant.c", level,
                    {"ELEM_BF16": int(dtype == torch.bfloat16), "BITS": bits})
    return None if library is None else QuantGemm(library, dtype, bits)


def quant_kernels(level: CpuLevel, dtype: torch.dtype) -> dict[int, QuantKernel]:
    """The small-step kernels on quantized blocks, by bits, that the model uses here."""
    if level is CpuLevel.NONE or dtype not in (torch.bfloat16, torch.float32):
        return {}
    if level.native_bf16 and dtype == torch.bfloat16:
        return {4: TorchInt4(4 if level >= CpuLevel.AMX else 8)}
    kernels = {bits: quant_gemm(level, dtype, bits) for bits in (4, 8)}
    return {bits: kernel for bits, kernel in kernels.items() if kernel is not None}
