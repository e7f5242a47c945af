"""The matmul kernels: y = x @ w.T with a weight packed once at load.

- `gemm_bf16.c` (level avx512_bf16): bfloat16 with VDPBF16PS, for decode-sized batches (up
  to `Bf16Gemm.max_rows`); oneDNN does larger ones. It prefetches the next weight panel while
  it multiplies the current one, which oneDNN leaves exposed at those sizes.
- `gemm_fma.c` (levels avx2 and avx512): float32 FMA for bfloat16 or float32 weights, any
  batch size; how bfloat16 runs on a CPU without a bfloat16 dot product, and float32's
  matmul at level avx2 (faster than MKL's sgemm there at every size, measured).

Both take a `PackedWeight` from their own `pack` (each has its own layout).
"""

import ctypes
from dataclasses import dataclass

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel

_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight in one kernel's layout."""

    data: torch.Tensor     # the kernel's layout (not a matrix)
    out_features: int      # n
    in_features: int       # k


class Bf16Gemm:
    """`gemm_bf16.c`: x @ w.T in bfloat16 (bf16 products, float32 sums) with VDPBF16PS."""

    __slots__ = ("lib",)
    PANEL = 48   # output columns per packed panel (NR in gemm_bf16.c)
    # Up to this many rows it hides the weight stream that oneDNN leaves exposed (30 layers at
    # 64 rows: 35 against 42 ms, measured); from here on oneDNN's blocking is as fast or faster.
    max_rows: int | None = 128

    def __init__(self, library: ctypes.CDLL):
        self.lib = library
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
    if dtype == torch.float32 and level >= CpuLevel.AVX512:
        # Measured only on AVX2 (Zen 2: 1.3-2x MKL's sgemm at every size); on AVX-512 MKL
        # stays until this kernel is measured there (bench/cpu_kernels.py --dtype float32).
        return None
    return fma_gemm(level, dtype)


def bf16_gemm(level: CpuLevel) -> Bf16Gemm | None:
    """`gemm_bf16.c`, at level avx512_bf16 only."""
    library = build("gemm_bf16.c", level, {}) if level.native_bf16 else None
    return None if library is None else Bf16Gemm(library)


def fma_gemm(level: CpuLevel, dtype: torch.dtype) -> FmaGemm | None:
    """`gemm_fma.c` for `dtype` activations and weights, at any level with AVX2."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    bf16 = int(dtype == torch.bfloat16)
    library = build("gemm_fma.c", level, {"ELEM_BF16": bf16, "W_BF16": bf16})
    return None if library is None else FmaGemm(library, dtype, dtype)
