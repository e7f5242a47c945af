"""GPU kernels in Triton, each beside its plain-torch twin: the worker's CUDA counterpart of
the C kernels in worker_svc.kernels, with the same contracts.

- `kv_write.py`: `write_kv`, a step's new K/V into their cache slots (negative slot: skip),
  and the fp8 cache formats' encoding and decoding, by bit operations.
- `paged_attention.py`: `paged_attention`, every row of a step (decode and prefill tokens
  alike) attending its request's keys straight from the paged cache; and
  `paged_attention_with_write`, the two together as a layer calls them.
- `norm.py`: `add_rms_norm`, residual add + RMSNorm in one pass.
- `rotary.py`: `rotary_`, RoPE in place on the q/k heads of the fused qkv rows.
- `activation.py`: `silu_mul`, the MLP's SiLU-and-multiply.
- `checks.py`: the argument checks the launchers share (wrong input: ValueError).

Every module holds the `@triton.jit` kernel, its launcher (checks, allocates, launches) and
a `*_reference` twin in vectorised torch with the same signature: the tests' oracle, and the
statement of what the kernel computes. `TritonKernels` and `TritonPagedAttention` below have
the methods of worker_svc.kernels' `ElementwiseKernels` and `PagedAttentionKernel`, so that a
model can take either set.

Why Triton: one source compiles for the GPU at hand, the kernels stay short enough to read
next to their twins, and each fuses what torch runs as several launches (the per-token steps
are launch-bound at decode sizes, and attention from the paged blocks needs no gathered
copy). Kernel shape constants are `tl.constexpr`, so Triton compiles (and caches) one
variant per model shape.

Testing without a GPU: with TRITON_INTERPRET=1 in the environment before triton is imported
(the kernels read it when they are decorated), Triton runs kernels on CPU tensors in numpy.
float32 and float16 compute correctly there, bfloat16 does not, so the CPU tests
(tests/worker_svc/test_triton_kernels.py) use float32 and float16 and mark bfloat16 `gpu`.
Its fp8 casts are wrong too, hence the bit operations of kv_write; the fp8 cache's tests
(test_triton_fp8.py) also compile those kernels for sm_90 with Triton's real code generator.

triton is imported only when a kernel module is: `import worker_svc.triton_kernels` works
without it, and the first kernel call raises a RuntimeError saying what is missing.
"""

import importlib
import importlib.util
from types import ModuleType

import torch

from worker_svc.kernels.kv_quant import KvScales, is_fp8
from worker_svc.triton_kernels.checks import interpreting

__all__ = ["TritonKernels", "TritonPagedAttention", "triton_available"]


def triton_available() -> bool:
    """Whether the kernels can run here: triton importable, and CUDA present or the
    interpreter on (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreting() or torch.cuda.is_available()


def _kernel_module(name: str) -> ModuleType:
    """worker_svc.triton_kernels.<name>, imported on first use (it imports triton)."""
    try:
        return importlib.import_module(f"worker_svc.triton_kernels.{name}")
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        raise RuntimeError("worker_svc.triton_kernels needs the triton package (pip install "
                           "triton), and CUDA or TRITON_INTERPRET=1 to run") from e


class TritonKernels:
    """The per-token steps of a layer in Triton: the methods of worker_svc.kernels'
    `ElementwiseKernels` (and of its torch twin `TorchElementwise`), for any of float32,
    float16 and bfloat16 (every operand in one dtype)."""

    __slots__ = ()

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [rows, dim] (residual None: x alone) -> (x + residual, its RMSNorm
        times weight), both new tensors."""
        return _kernel_module("norm").add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, then up) -> silu(gate) * up, [rows, inter]."""
        return _kernel_module("activation").silu_mul(gate_up)

    def rotary_(self, x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first `num_heads` heads of each row of x [rows, width >=
        num_heads * head_dim] by the cos / signed-sin tables [max_positions, head_dim] at
        positions [rows] (int64)."""
        _kernel_module("rotary").rotary_(x, num_heads, head_dim, positions, cos, sin)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] -> int64 [rows]: each row's first maximum. Plain torch, not Triton: on
        a GPU torch's argmax is one launch already, and float32 keeps ties as on CPU."""
        if x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax: expected [rows, cols > 0], got {tuple(x.shape)}")
        return x.float().argmax(dim=-1)


class TritonPagedAttention:
    """Write a step's K/V, then attend every row from the paged cache, in Triton: a drop-in
    for worker_svc.kernels' `PagedAttentionKernel` (same constructor fields and call)."""

    __slots__ = ("head_dim", "group", "dtype", "kv_dtype", "kv_scales")

    def __init__(self, head_dim: int, group: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, kv_scales: KvScales | None = None):
        """For heads of `head_dim` (a power of two, 16..256), `group` query heads per KV
        head, tensors of `dtype`, a cache of `kv_dtype` (None: `dtype`; or float8_e4m3fn /
        float8_e5m2, read and written with `kv_scales`, worker_svc.kernels.kv_quant);
        ValueError for a shape or dtype the kernel does not take."""
        if head_dim not in (16, 32, 64, 128, 256) or group < 1:
            raise ValueError(f"Triton paged attention: head_dim {head_dim} (need a power of two "
                             f"in 16..256) or group {group} not supported")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"Triton paged attention: dtype {dtype} not supported")
        kv_dtype = kv_dtype or dtype
        if kv_dtype != dtype and not is_fp8(kv_dtype):
            raise ValueError(f"Triton paged attention: a {kv_dtype} cache for {dtype} compute "
                             "(need the compute dtype or float8)")
        self.head_dim, self.group, self.dtype = head_dim, group, dtype
        self.kv_dtype, self.kv_scales = kv_dtype, kv_scales or KvScales()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 row_request: torch.Tensor, kv_lens: torch.Tensor, window: int = 0
                 ) -> torch.Tensor:
        """Write k, v into their slots, then attend: the contract of the C kernel's
        `PagedAttentionKernel.__call__` (shapes, meaning and `window` there), plus: a negative
        slot is not written. Scale head_dim ** -0.5; an 8-bit cache with this kernel's scales."""
        num_heads, head_dim = q.shape[1:] if q.dim() == 3 else (0, 0)
        num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 0
        if (head_dim != self.head_dim or q.dtype != self.dtype
                or kv_cache.dtype != self.kv_dtype or num_heads != num_kv_heads * self.group):
            raise ValueError(f"Triton paged attention for head_dim {self.head_dim}, group "
                             f"{self.group}, {self.dtype}, a {self.kv_dtype} cache: got q "
                             f"{tuple(q.shape)} {q.dtype} and kv_cache {tuple(kv_cache.shape)} "
                             f"{kv_cache.dtype}")
        module = _kernel_module("paged_attention")
        return module.paged_attention_with_write(q, k, v, kv_cache, slot_mapping, block_tables,
                                                 row_request, kv_lens, head_dim ** -0.5,
                                                 window, self.kv_scales)
