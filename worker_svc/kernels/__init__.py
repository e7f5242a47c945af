"""CPU kernels in C, compiled on the worker's machine at start and called through ctypes.

- `cpu.py`: the CPU feature level (amx, avx512_bf16, avx512, avx2, none) a worker runs at.
- `build.py`: compiles a kernel for a level's `-march`, caches and loads it.
- `paged_attention.py` / `.c`: attention read straight from the paged KV blocks (its torch
  twin is worker_svc.attention's torch path).
- `elementwise.py` / `.c`: residual add + RMSNorm, SiLU-and-multiply, rotary, argmax, and
  their torch twin `TorchElementwise`.
- `gemm.py`, `gemm_bf16.c`, `gemm_fma.c`: matmuls on pre-packed weights; `gemm_quant.c`:
  small steps on a GGUF's quantized blocks; `gemm_amx.py` / `.c`: bfloat16 on AMX tiles (and
  on quantized blocks dequantized in cache, `AmxBlocksGemm`: not yet used by the model);
  `gemm_amx_quant.py` / `.c`: float32 on a GGUF's quantized blocks on AMX tiles (exact
  products), every step larger than gemm_quant.c's.
- `gemm_int8.py`, `gemm_int8.c` / `gemm_int8_amx.c`: `--quantization int8`, weights in int8 with
  a scale per output column and activations quantized per row on the fly, on AVX512-VNNI or
  AMX-INT8 (and their torch twin).
- `quant_blocks.py`: those quantized blocks' format (the weights loader produces it).

The package is a leaf: nothing here imports the rest of worker_svc (tests/test_structure.py
checks). Which kernels a worker runs is decided once, by worker_svc.kernel_choice.

Why compiled here: a level's `-march` and the model's head size as constants give GCC
fixed-size loops over vector registers, and a build takes well under a second with only a C
compiler (no torch headers, no Python extension module). At level `none`, or where a kernel
does not build, the model uses the torch twin of that part (same results, slower). The GPU's
kernels are Triton, in worker_svc/triton_kernels.
"""

from dataclasses import dataclass, field, replace

import torch

from worker_svc.kernels.cpu import CpuLevel
from worker_svc.kernels.elementwise import ElementwiseKernels, elementwise_kernels
from worker_svc.kernels.gemm import (
    Bf16Gemm,
    FmaGemm,
    Gemm,
    PackedQuant,
    PackedWeight,
    QuantGemm,
    QuantKernel,
    TorchInt4,
    gemm_kernel,
    quant_kernels,
)
from worker_svc.kernels.gemm_amx import AmxGemm, amx_gemm
from worker_svc.kernels.gemm_amx_quant import AmxQuantGemm, TieredPack, TieredQuant, amx_quant_gemm
from worker_svc.kernels.gemm_int8 import Int8Gemm, PackedInt8, int8_gemm
from worker_svc.kernels.kv_quant import KvScales
from worker_svc.kernels.paged_attention import PagedAttentionKernel, paged_attention_kernel
from worker_svc.kernels.quant_blocks import QUANT_BLOCK, QuantBlocks

__all__ = ["QUANT_BLOCK", "AmxGemm", "AmxQuantGemm", "Bf16Gemm", "LayerKernels", "CpuLevel",
           "ElementwiseKernels", "FmaGemm", "Gemm", "Int8Gemm", "PackedInt8", "PackedQuant",
           "PackedWeight",
           "PagedAttentionKernel", "QuantBlocks", "QuantGemm", "QuantKernel", "TieredPack",
           "TieredQuant", "TorchInt4", "load_cpu_kernels", "with_int8"]


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """The kernels a model's layers use; a None field = that part in torch. On a CPU these are
    the C kernels of one level; on a GPU the Triton kernels (worker_svc.triton_kernels, with
    `level` none, no gemm: matmuls are torch's, cuBLAS). `worker_svc.kernel_choice` picks."""

    level: CpuLevel
    attention: "PagedAttentionKernel | TritonPagedAttention | None" = None  # noqa: F821
    elementwise: "ElementwiseKernels | TritonKernels | None" = None  # noqa: F821
    gemm: Gemm | AmxGemm | None = None
    # by block bits: small steps (max_rows), or every step (TieredQuant, max_rows None)
    quant: dict[int, QuantKernel | TieredQuant] = field(default_factory=dict)
    # --quantization int8: the decoder layers' matmuls, on weights quantized at load (None:
    # dense weights). Set by `with_int8` only when asked: the kernel changes the results.
    int8: Int8Gemm | None = None

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN's bfloat16 matmul may run (it needs AVX-512 BW/VL/DQ; at a forced
        lower level it is not used, so that level runs its own paths only)."""
        return self.level >= CpuLevel.AVX512


def load_cpu_kernels(level: CpuLevel, head_dim: int, group: int, dtype: torch.dtype,
                     kv_dtype: torch.dtype | None = None, kv_scales: KvScales | None = None,
                     int8: bool = False) -> LayerKernels:
    """The kernels that build for this level and model shape (`group`: query heads per KV
    head; `kv_dtype`: the KV cache's element type, None = `dtype`, with `kv_scales` where it
    is 8-bit; `int8`: with the int8 matmul, see `with_int8`)."""
    attention = paged_attention_kernel(level, head_dim, group, dtype, kv_dtype or dtype,
                                       kv_scales)
    kernels = LayerKernels(level, attention,
                           elementwise_kernels(level, dtype), _gemm(level, dtype),
                           _quant(level, dtype))
    return with_int8(kernels) if int8 else kernels


def with_int8(kernels: LayerKernels) -> LayerKernels:
    """`kernels` with its level's int8 matmul (`--quantization int8`): AMX-INT8 tiles at level
    amx, AVX512-VNNI at avx512_bf16 (and at amx without AMX-INT8). ValueError, naming the
    level, where there is none: a worker does not quietly serve dense weights when asked for
    int8."""
    kernel = int8_gemm(kernels.level)
    if kernel is None:
        raise ValueError(f"--quantization int8 needs an int8 matmul kernel, and CPU level "
                         f"{kernels.level.label} has none: it runs at level avx512_bf16 with "
                         f"AVX512-VNNI or level amx, on the C kernels (the CPU's)")
    return replace(kernels, int8=kernel)


def _quant(level: CpuLevel, dtype: torch.dtype) -> dict[int, QuantKernel | TieredQuant]:
    """The kernels on quantized blocks: `gemm.quant_kernels`' small-step ones, and at level
    amx in float32 the AMX kernel for every larger step (`TieredQuant`)."""
    small = quant_kernels(level, dtype)
    if dtype != torch.float32 or level < CpuLevel.AMX or not (large := amx_quant_gemm(level)):
        return dict(small)
    return {bits: TieredQuant(kernel, large) if isinstance(kernel, QuantGemm) else kernel
            for bits, kernel in small.items()}


def _gemm(level: CpuLevel, dtype: torch.dtype) -> Gemm | AmxGemm | None:
    """The matmul kernel for `dtype` at `level`: on AMX tiles for bfloat16 at level amx (up
    to 128 rows; oneDNN beyond), else `gemm.gemm_kernel`'s choice."""
    if dtype == torch.bfloat16 and level >= CpuLevel.AMX and (amx := amx_gemm(level)):
        return amx
    return gemm_kernel(level, dtype)
