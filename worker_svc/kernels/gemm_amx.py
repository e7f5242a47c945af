"""`gemm_amx.c`: y = x @ w.T in bfloat16 on AMX tiles (TDPBF16PS), with the weight packed once
at load into the kernel's tile layout. Same interface as `gemm.Bf16Gemm`; the model's Linear
picks between it, `Bf16Gemm` and oneDNN by row count (`max_rows`).

The tiles are process state Linux grants on request, so the constructor asks
(`cpu.request_amx`) and refuses to exist without it: a tile instruction without the grant
kills the process with SIGILL.
"""

import ctypes

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel, request_amx
from worker_svc.kernels.gemm import PackedWeight, _check_rows

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
