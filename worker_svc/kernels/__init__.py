"""CPU kernels in C, compiled on this machine when a worker starts and called through ctypes.

- `paged_attention.c`: attention for every row of a step (decodes and prefill tokens) read
  from the paged blocks where they lie. In torch that needs a gathered copy of every
  request's keys and values per layer, padded batches and masks; this is 2-3x faster
  (bench/cpu_kernels.py).
- `elementwise.c`: residual add + RMSNorm, SiLU-and-multiply, and rotary embedding, one pass
  each instead of several torch kernels whose per-call overhead dominates at decode sizes.
- `gemm_bf16.c` (CPUs with AVX512-BF16 only): bfloat16 matmul for decode-sized batches that
  prefetches the next weight panel while it multiplies the current one (oneDNN leaves the
  weight stream exposed there; see the source).

Why compiled here: `-march=native` and the model's head size as constants give GCC
fixed-size loops over vector registers, and a build takes well under a second with only a C
compiler (no torch headers, no Python extension module).

A build is cached under `$SPLITSERVE_KERNEL_DIR` (default `~/.cache/splitserve/kernels`),
named by a hash of the source, the flags, the compiler and this CPU's feature flags, so a
cache shared between machines never hands one CPU code built for another. Builds are
written to a temporary file and renamed, so workers starting together do not collide.

If there is no C compiler or the build fails, `paged_attention_kernel` returns None, the worker
logs why once, and attention uses the torch path (same results, slower).
`SPLITSERVE_CPU_KERNELS=0` turns the kernels off.

The kernels use OpenMP through the libgomp torch already loaded (same soname), so
`torch.set_num_threads` sizes their thread pool too.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_libraries: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}
_warned: set[str] = set()


def kernels_enabled() -> bool:
    return os.environ.get("SPLITSERVE_CPU_KERNELS", "1") not in ("0", "false", "no", "off")


def _cpuinfo_lines(*prefixes: str) -> list[str]:
    """The distinct /proc/cpuinfo lines starting with these prefixes ([] where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({line for line in text.splitlines() if line.startswith(prefixes)})


def _cpu_signature() -> str:
    """This CPU's model and feature flags (Linux), else the platform's description."""
    lines = _cpuinfo_lines("model name", "flags")
    return "\n".join(lines) if lines else platform.processor() + platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    configured = os.environ.get("SPLITSERVE_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "splitserve" / "kernels"


def build(source: str, defines: dict[str, int]) -> ctypes.CDLL | None:
    """Compile `source` (a file beside this module) with `-D` defines, or take it from the
    cache; load it. None (with one warning) where that cannot be done."""
    flags = tuple(f"-D{k}={v}" for k, v in sorted(defines.items())) + CFLAGS
    key = (source, flags)
    if key in _libraries:
        return _libraries[key]
    library = None
    try:
        library = _build(SOURCE_DIR / source, flags)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        if source not in _warned:
            _warned.add(source)
            log.warning("CPU kernel %s unavailable, using the torch path: %s", source, e)
    _libraries[key] = library
    return library


def _build(path: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    headers = [h.read_text() for h in sorted(path.parent.glob("*.h"))]
    digest = hashlib.sha256("\0".join([path.read_text(), *headers, *flags, version,
                                       _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, str(path), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
            log.info("built CPU kernel %s", target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def _cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU feature flag (False where there is none)."""
    return any(flag in line.split()[2:] for line in _cpuinfo_lines("flags"))


def _lanes(head_dim: int) -> int | None:
    for lanes in (16, 8, 4):
        if head_dim % lanes == 0:
            return lanes
    return None


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class PagedAttentionKernel:
    """`paged_attention.c` for one (head_dim, query heads per KV head, dtype)."""

    __slots__ = ("fn", "head_dim", "group", "dtype")

    def __init__(self, library: ctypes.CDLL, head_dim: int, group: int, dtype: torch.dtype):
        self.fn = library.paged_attention
        self.fn.restype = None
        self.fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I,
                            _F, _P]
        self.head_dim, self.group, self.dtype = head_dim, group, dtype

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 row_request: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
        """Write k, v into their slots, then attend. q [rows, num_heads, head_dim], one query
        token per row; k, v [rows, num_kv_heads, head_dim] (rows may be strided; heads and
        dim contiguous); kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
        contiguous; slot_mapping [rows] int64: each row's cache slot; block_tables [requests,
        max_blocks] int64; row_request [rows] int64: each row's request; kv_lens [rows]
        int64: the keys each row attends to (its position + 1). Returns [rows, heads * dim].
        """
        rows, num_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        index_ok = all(t.dtype == torch.int64 and t.shape == (rows,) and t.is_contiguous()
                       for t in (slot_mapping, row_request, kv_lens))
        rows_ok = all(t.dtype == self.dtype and t.stride(2) == 1 and t.stride(1) == head_dim
                      for t in (q, k, v))
        if (head_dim != self.head_dim or num_heads != num_kv_heads * self.group
                or not rows_ok or not index_ok or kv_cache.dtype != self.dtype
                or k.shape != (rows, num_kv_heads, head_dim) or v.shape != k.shape
                or not kv_cache.is_contiguous() or block_tables.dtype != torch.int64
                or not block_tables.is_contiguous()):
            raise ValueError("paged attention kernel: unexpected shapes, strides or dtypes")
        out = torch.empty(rows, num_heads * head_dim, dtype=q.dtype)
        self.fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                slot_mapping.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(),
                block_tables.shape[1], row_request.data_ptr(), kv_lens.data_ptr(), rows,
                num_kv_heads, num_blocks, block_size, head_dim ** -0.5, out.data_ptr())
        return out


def paged_attention_kernel(head_dim: int, group: int, dtype: torch.dtype
                           ) -> PagedAttentionKernel | None:
    """The attention kernel for this shape, or None (use the torch path)."""
    lanes = _lanes(head_dim)
    if not kernels_enabled() or lanes is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    library = build("paged_attention.c", {"HEAD_DIM": head_dim, "GROUP": group, "LANES": lanes,
                                          "ELEM_BF16": int(dtype == torch.bfloat16)})
    return None if library is None else PagedAttentionKernel(library, head_dim, group, dtype)


class ElementwiseKernels:
    """`elementwise.c` for one dtype: the per-token steps of a layer in one pass each."""

    __slots__ = ("lib", "dtype")

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype):
        self.lib, self.dtype = library, dtype
        library.add_rms_norm.restype = None
        library.add_rms_norm.argtypes = [_P, _P, _P, _F, _P, _P, _I, _I]
        library.silu_mul.restype = None
        library.silu_mul.argtypes = [_P, _P, _I, _I]
        library.rotary.restype = None
        library.rotary.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I]
        library.argmax_rows.restype = None
        library.argmax_rows.argtypes = [_P, _I, _I, _P]

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != self.dtype or not t.is_contiguous():
                raise ValueError(f"elementwise kernel: expected contiguous {self.dtype}, got "
                                 f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [rows, dim] (residual None: x alone) -> (x + residual, its RMSNorm
        times weight), both new tensors."""
        self._check(x, weight, *(() if residual is None else (residual,)))
        rows, dim = x.shape
        if weight.shape != (dim,) or (residual is not None and residual.shape != x.shape):
            raise ValueError("add_rms_norm: mismatched shapes")
        new_residual, normed = torch.empty_like(x), torch.empty_like(x)
        self.lib.add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                              weight.data_ptr(), eps, new_residual.data_ptr(),
                              normed.data_ptr(), rows, dim)
        return new_residual, normed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, then up) -> silu(gate) * up, [rows, inter]."""
        self._check(gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rotary_(self, x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first `num_heads` heads of each row of x [rows, width >=
        num_heads * head_dim] (rows contiguous) by the cos / signed-sin tables [max_positions,
        head_dim] at positions [rows] (int64)."""
        self._check(x, cos, sin)
        if (positions.dtype != torch.int64 or not positions.is_contiguous()
                or positions.shape != (x.shape[0],) or x.shape[1] < num_heads * head_dim
                or cos.shape[1] != head_dim or sin.shape != cos.shape or head_dim % 2):
            raise ValueError("rotary: mismatched shapes")
        self.lib.rotary(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
                        sin.data_ptr(), x.shape[0], num_heads, head_dim)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] -> int64 [rows]: each row's first maximum, as torch.argmax(dim=-1)."""
        self._check(x)
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax: expected [rows, cols > 0], got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out


def elementwise_kernels(dtype: torch.dtype) -> ElementwiseKernels | None:
    """The elementwise kernels for this dtype, or None (use torch)."""
    if not kernels_enabled() or dtype not in (torch.bfloat16, torch.float32):
        return None
    library = build("elementwise.c", {"ELEM_BF16": int(dtype == torch.bfloat16)})
    return None if library is None else ElementwiseKernels(library, dtype)


GEMM_PANEL = 48   # output columns per packed weight panel (NR in gemm_bf16.c)


class Bf16Gemm:
    """`gemm_bf16.c`: x @ w.T in bfloat16 with a weight packed once by `pack`."""

    __slots__ = ("lib",)

    def __init__(self, library: ctypes.CDLL):
        self.lib = library
        library.pack_weight.restype = None
        library.pack_weight.argtypes = [_P, _P, _I, _I]
        library.gemm_bf16.restype = None
        library.gemm_bf16.argtypes = [_P, _P, _P, _I, _I, _I]

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether `pack` takes this [n, k] weight: bfloat16, n a multiple of GEMM_PANEL, k
        even, neither empty."""
        return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.numel() > 0
                and weight.shape[0] % GEMM_PANEL == 0 and weight.shape[1] % 2 == 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[n, k] -> the kernel's layout, in a tensor of the same shape (not a matrix)."""
        if not self.fits(weight):
            raise ValueError(f"gemm_bf16: cannot pack {weight.dtype} {tuple(weight.shape)}")
        weight = weight.contiguous()
        packed = torch.empty_like(weight)
        self.lib.pack_weight(weight.data_ptr(), packed.data_ptr(), *weight.shape)
        return packed

    def __call__(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [m, k] contiguous bfloat16, packed from a [n, k] weight -> [m, n]."""
        n, k = packed.shape
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k
                or not x.is_contiguous()):
            raise ValueError(f"gemm_bf16: expected contiguous bfloat16 [m, {k}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        out = x.new_empty(x.shape[0], n)
        self.lib.gemm_bf16(x.data_ptr(), packed.data_ptr(), out.data_ptr(), x.shape[0], n, k)
        return out


def bf16_gemm_kernel() -> Bf16Gemm | None:
    """The decode-size bfloat16 matmul, or None (oneDNN does them all): only on CPUs with
    AVX512-BF16."""
    if not kernels_enabled() or not _cpu_has("avx512_bf16"):
        return None
    library = build("gemm_bf16.c", {})
    return None if library is None else Bf16Gemm(library)
