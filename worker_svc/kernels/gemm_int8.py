"""int8 matmuls for `--quantization int8`: y = x @ w.T with w quantized once at load (int8,
one float32 scale per output column, symmetric, round to nearest even) and x quantized per
row on the fly (scale = max |row| / 127), exact int32 sums, then y = sum * x_scale[row] *
w_scale[col] in float32, rounded once to x's dtype (bfloat16 or float32).

- `gemm_int8.c` (`VnniInt8Gemm`, levels avx512_bf16 and amx, where the CPU has AVX512-VNNI):
  VPDPBUSD, 64 multiply-adds an instruction (VDPBF16PS: 32), and half bfloat16's bytes a
  weight.
- `gemm_int8_amx.c` (`AmxInt8Gemm`, level amx with AMX-INT8): TDPBSSD on tiles.

Both quantize, sum and round exactly as the torch twin here (`quantize_rows`,
`int8_products`, `reference_matmul`), so tests compare bit for bit. The model's decoder-layer
matmuls take one of them for every step when asked (worker_svc.model.linear.Linear); the LM
head and the embedding stay dense.

Measured (bench/int8_gemm.py, 2 threads of an AMD EPYC Zen 5 at level avx512_bf16, SmolLM2's
four layer shapes, 30 distinct weights each, medians of 5 rounds): the VNNI kernel against
the bfloat16 model's Linear (gemm_bf16.c, oneDNN from 129 rows) 1.4-2.7x at 1 to 2,048 rows,
against float32's (gemm_fma.c) 3-6x; with the weights in cache it reaches ~880 GOP/s a core
against VDPBF16PS's ~490 GFLOP/s. A model decode step (SmolLM2, bfloat16): 64 rows 33.4
against 40.0 ms dense (1.2x: attention and the LM head stay); one row 5.9 against 8.3 ms
dense bfloat16, but 5.6 ms on the GGUF's Q4_1 blocks (a worker's default for small steps:
0.56 bytes a weight against int8's 1). Accuracy on SmolLM2 (tests/worker_svc/test_gemm_int8.py):
35 of 37 next tokens as the dense model's, mean |delta logprob| 0.19; weights alone in int8
give 0.06, the per-token activations the rest.
"""

import ctypes
from dataclasses import dataclass

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel, cpu_flags, request_amx

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_FLT_MAX = torch.finfo(torch.float32).max
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int32: 2}   # the C files' enum


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] -> (q [rows, k] int8, scale [rows] float32): q = round(x * 127 / max |row|)
    to nearest even, clamped to +-127, and scale = max |row| / 127 (a row of zeros: q 0,
    scale 0). What the kernels do to activations, and what `pack` does to weights."""
    x = x.float()
    top = x.abs().amax(dim=1)
    # IEEE divisions, as the kernels': torch's `127.0 / top` is 127 * (1 / top), rounded twice
    # (one ulp off in about 1 of 500 values, measured). 127 / top overflows for a denormal
    # top: FLT_MAX keeps x * inv finite (the kernels' rule).
    inv = torch.full_like(top, 127.0).div_(top)
    inv = torch.where(top > 0, inv, 0.0).clamp_(max=_FLT_MAX)
    q = torch.round(x * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, top.div(torch.full_like(top, 127.0))


def int8_products(qa: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """qa [m, k] @ qw [n, k].T in int32, exact: float64 holds every partial sum (each under
    127^2 k < 2^53)."""
    return (qa.double() @ qw.double().T).to(torch.int32)


def reference_matmul(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The slow twin of the kernels: x [m, k] (bfloat16 or float32) on the quantized weight
    qw [n, k] int8 with w_scale [n] -> [m, n] in x's dtype."""
    qa, a_scale = quantize_rows(x)
    sums = int8_products(qa, qw).float()
    return (sums * a_scale[:, None] * w_scale[None, :]).to(x.dtype)


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """A weight quantized and packed for one int8 kernel."""

    data: torch.Tensor           # int8, the kernel's layout (not a matrix)
    scales: torch.Tensor         # [columns padded to the panel] float32, 0 past n
    corrections: torch.Tensor    # VNNI: [same] int32, 128 * column sums; AMX: empty
    out_features: int            # n
    in_features: int             # k


class _Int8Gemm:
    """What the two kernels share: quantize and pack a weight, run, check shapes."""

    __slots__ = ("lib",)
    PANEL = 1
    MAX_K = 0                    # the k at which an int32 sum could overflow
    max_rows: int | None = None  # every step

    def __init__(self, library: ctypes.CDLL):
        self.lib = library
        library.packed_size.restype = ctypes.c_int64
        library.packed_size.argtypes = [_I, _I]
        library.quantize_rows.restype = None
        library.quantize_rows.argtypes = [_P, _C, _P, _P, _I, _I]

    def fits(self, weight: torch.Tensor) -> bool:
        """A non-empty [n, k] bfloat16 or float32 weight with k under the overflow bound."""
        return (weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float32)
                and weight.numel() > 0 and weight.shape[1] <= self.MAX_K)

    def pack(self, weight: torch.Tensor) -> PackedInt8:
        """Quantize [n, k] per output column (as `quantize_rows`) and pack it."""
        if not self.fits(weight):
            raise ValueError(f"int8 gemm: cannot pack {weight.dtype} {tuple(weight.shape)} "
                             f"(takes bfloat16 or float32 [n, k] with k <= {self.MAX_K})")
        return self.pack_quantized(*self.quantize(weight))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`quantize_rows` in C (bit for bit the same; ~10x faster on a weight, measured)."""
        x = x.contiguous()
        q = torch.empty(x.shape, dtype=torch.int8)
        scales = torch.empty(x.shape[0], dtype=torch.float32)
        self.lib.quantize_rows(x.data_ptr(), int(x.dtype == torch.bfloat16), q.data_ptr(),
                               scales.data_ptr(), *x.shape)
        return q, scales

    def pack_quantized(self, q: torch.Tensor, scales: torch.Tensor) -> PackedInt8:
        """An already quantized weight q [n, k] int8 with scales [n]."""
        n, k = q.shape
        padded = -(-n // self.PANEL) * self.PANEL
        data = torch.empty(self.lib.packed_size(n, k), dtype=torch.int8)
        corrections = self._pack(q.contiguous(), data, padded)
        w_scale = torch.zeros(padded, dtype=torch.float32)
        w_scale[:n] = scales
        return PackedInt8(data, w_scale, corrections, n, k)

    def __call__(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """x [m, k] contiguous bfloat16 or float32 -> [m, n] in x's dtype."""
        return self._run(x, w, x.dtype)

    def products(self, x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
        """The exact int32 sums qa @ qw.T before the float epilogue (for the tests)."""
        return self._run(x, w, torch.int32)

    def _run(self, x: torch.Tensor, w: PackedInt8, out_dtype: torch.dtype) -> torch.Tensor:
        if (x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2
                or x.shape[1] != w.in_features or not x.is_contiguous()):
            raise ValueError(f"int8 gemm: expected contiguous bfloat16 or float32 "
                             f"[m, {w.in_features}], got {x.dtype} {tuple(x.shape)}")
        out = torch.empty(x.shape[0], w.out_features, dtype=out_dtype)
        if x.shape[0]:
            self._gemm(x, w, out)
        return out

    def _pack(self, q: torch.Tensor, data: torch.Tensor, padded: int) -> torch.Tensor:
        raise NotImplementedError

    def _gemm(self, x: torch.Tensor, w: PackedInt8, out: torch.Tensor) -> None:
        raise NotImplementedError


class VnniInt8Gemm(_Int8Gemm):
    """`gemm_int8.c`: AVX512-VNNI (unsigned activations shifted by 128, the shift's share
    subtracted per column)."""

    __slots__ = ()
    PANEL = 48
    MAX_K = 65536       # 255 * 127 * k < 2^31

    def __init__(self, library: ctypes.CDLL):
        super().__init__(library)
        library.pack_weight.restype = None
        library.pack_weight.argtypes = [_P, _P, _P, _I, _I]
        library.gemm_int8.restype = None
        library.gemm_int8.argtypes = [_P, _C, _P, _P, _P, _P, _C, _I, _I, _I]

    def _pack(self, q: torch.Tensor, data: torch.Tensor, padded: int) -> torch.Tensor:
        corrections = torch.zeros(padded, dtype=torch.int32)
        self.lib.pack_weight(q.data_ptr(), data.data_ptr(), corrections.data_ptr(), *q.shape)
        return corrections

    def _gemm(self, x: torch.Tensor, w: PackedInt8, out: torch.Tensor) -> None:
        self.lib.gemm_int8(x.data_ptr(), int(x.dtype == torch.bfloat16), w.data.data_ptr(),
                           w.corrections.data_ptr(), w.scales.data_ptr(), out.data_ptr(),
                           _OUT_KIND[out.dtype], x.shape[0], w.out_features, w.in_features)


class AmxInt8Gemm(_Int8Gemm):
    """`gemm_int8_amx.c`: AMX-INT8 tiles (signed by signed). The tiles are process state Linux
    grants on request: the constructor asks and refuses to exist without them."""

    __slots__ = ()
    PANEL = 32
    MAX_K = 131072      # 127 * 127 * k < 2^31

    def __init__(self, library: ctypes.CDLL):
        reason = request_amx()
        if reason is not None:
            raise RuntimeError(f"gemm_int8_amx: no AMX tiles for this process: {reason}")
        super().__init__(library)
        library.pack_weight.restype = None
        library.pack_weight.argtypes = [_P, _P, _I, _I]
        library.gemm_int8_amx.restype = None
        library.gemm_int8_amx.argtypes = [_P, _C, _P, _P, _P, _C, _I, _I, _I]

    def _pack(self, q: torch.Tensor, data: torch.Tensor, padded: int) -> torch.Tensor:
        self.lib.pack_weight(q.data_ptr(), data.data_ptr(), *q.shape)
        return torch.empty(0, dtype=torch.int32)

    def _gemm(self, x: torch.Tensor, w: PackedInt8, out: torch.Tensor) -> None:
        self.lib.gemm_int8_amx(x.data_ptr(), int(x.dtype == torch.bfloat16), w.data.data_ptr(),
                               w.scales.data_ptr(), out.data_ptr(), _OUT_KIND[out.dtype],
                               x.shape[0], w.out_features, w.in_features)


Int8Gemm = VnniInt8Gemm | AmxInt8Gemm


def vnni_int8_gemm(level: CpuLevel, flags: frozenset[str] | None = None) -> VnniInt8Gemm | None:
    """`gemm_int8.c` at levels avx512_bf16 and amx where the CPU (or `flags`) has VNNI."""
    if level < CpuLevel.AVX512_BF16:
        return None
    if "avx512_vnni" not in (cpu_flags() if flags is None else flags):
        return None
    library = build("gemm_int8.c", level, {})
    return None if library is None else VnniInt8Gemm(library)


def amx_int8_gemm(level: CpuLevel, flags: frozenset[str] | None = None) -> AmxInt8Gemm | None:
    """`gemm_int8_amx.c` at level amx where the CPU (or `flags`) has AMX-INT8 and Linux
    grants the tiles."""
    if level < CpuLevel.AMX or "amx_int8" not in (cpu_flags() if flags is None else flags):
        return None
    if request_amx() is not None:
        return None
    library = build("gemm_int8_amx.c", level, {})
    return None if library is None else AmxInt8Gemm(library)


def int8_gemm(level: CpuLevel) -> Int8Gemm | None:
    """The int8 kernel a worker at `level` runs: AMX tiles at level amx, else VNNI from level
    avx512_bf16; None below (then `--quantization int8` is refused)."""
    return amx_int8_gemm(level) or vnni_int8_gemm(level)
