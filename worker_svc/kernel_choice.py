"""Which kernels a worker's layers run: the one place that decides, called once by the runner
(worker_svc.runner) when it builds its model; the model takes the set it is given.

- `c`: the CPU's C kernels at the worker's level (worker_svc.kernels), the CPU default;
- `triton`: the Triton kernels (worker_svc.triton_kernels), the CUDA default; on a CPU they
  run only under `TRITON_INTERPRET=1` (tests: the GPU's code path, checked without a GPU);
- `torch`: plain torch ops everywhere (the twins; slow, any device).

Matmuls are torch's on CUDA (cuBLAS) and with `triton` / `torch`; the C kernels bring their own
CPU matmuls. `SPLITSERVE_KERNELS` overrides the choice (tests, debugging).
"""

import os

import torch

from worker_svc.kernels import CpuLevel, LayerKernels, load_cpu_kernels
from worker_svc.kernels.cpu import detect_level
from worker_svc.kernels.kv_quant import KvScales

CHOICES = ("auto", "c", "triton", "torch")


def choose_kernels(device: torch.device, level: CpuLevel | None, head_dim: int, group: int,
                   dtype: torch.dtype, choice: str | None = None,
                   kv_dtype: torch.dtype | None = None, kv_scales: KvScales | None = None
                   ) -> LayerKernels:
    """The kernel set for this device and model shape. `level`: the C kernels' (None: the
    best this CPU has). `group`: query heads per KV head on this rank. `choice` None:
    `SPLITSERVE_KERNELS`, else auto. `kv_dtype`: the KV cache's element type (None: `dtype`),
    with `kv_scales` where it is 8-bit (worker_svc.kernels.kv_quant)."""
    choice = resolve_choice(device, choice)
    kv_dtype = kv_dtype or dtype
    kv_scales = kv_scales or KvScales()
    if choice == "c":
        if device.type != "cpu":
            raise ValueError("the C kernels run on the CPU only")
        return load_cpu_kernels(detect_level() if level is None else level, head_dim, group,
                                dtype, kv_dtype, kv_scales)
    if choice == "torch":
        return LayerKernels(CpuLevel.NONE)
    from worker_svc.triton_kernels import TritonKernels, TritonPagedAttention, triton_available

    if not triton_available():
        raise ValueError("the Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 on a CPU")
    return LayerKernels(CpuLevel.NONE,
                        attention=TritonPagedAttention(head_dim, group, dtype, kv_dtype,
                                                       kv_scales),
                        elementwise=TritonKernels())


def resolve_choice(device: torch.device, choice: str | None = None) -> str:
    """"c", "triton" or "torch" for this device: `choice`, else `SPLITSERVE_KERNELS`, else
    auto. A worker checks at start that the C kernels build only where it runs them."""
    choice = (choice or os.environ.get("SPLITSERVE_KERNELS") or "auto").lower()
    if choice not in CHOICES:
        raise ValueError(f"kernels {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "c"
    return choice
