"""Argument checks shared by the Triton launchers.

A kernel indexes raw memory from the pointers and strides it is given, so a wrong dtype,
shape, stride or device must fail here, in Python, with a message naming the argument, not
read or write the wrong bytes. This module imports torch and kv_quant only (never triton), so
that the package's `__init__` can use `interpreting` without triton installed.
"""

import os

import torch

from worker_svc.kernels.kv_quant import FP8_DTYPES

# The dtypes the kernels compute on (in float32 inside, stored back in the input dtype).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET set true)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def check_device(kernel: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and one that Triton can run on: CUDA, or any device while
    interpreting (the interpreter copies CUDA tensors to the host and back)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{kernel}: tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{kernel}: tensors on {device}; Triton kernels need CUDA tensors, or "
                         "TRITON_INTERPRET=1 (set before triton is imported) to run on the CPU")


def check_float(kernel: str, name: str, t: torch.Tensor, dtype: torch.dtype | None = None
                ) -> None:
    """t has a kernel dtype, and `dtype` where given (the dtype of the other operands)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kernel}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{kernel}: {name} is {t.dtype}, expected {dtype} like the others")


def check_kv_cache_dtype(kernel: str, kv_cache: torch.Tensor,
                         dtype: torch.dtype | None = None) -> None:
    """The cache holds a kernel dtype (`dtype` where given: the compute dtype) or one of the
    8-bit formats (worker_svc.kernels.kv_quant), whatever the compute dtype."""
    if kv_cache.dtype in FP8_DTYPES:
        return
    if kv_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{kernel}: kv_cache must be float32, float16, bfloat16, "
                         f"float8_e4m3fn or float8_e5m2, got {kv_cache.dtype}")
    check_float(kernel, "kv_cache", kv_cache, dtype)


def check_contiguous(kernel: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{kernel}: {name} must be contiguous, got strides {t.stride()}")


def check_index(kernel: str, name: str, t: torch.Tensor, length: int) -> None:
    """t is a contiguous int64 vector of `length` entries."""
    if t.dtype != torch.int64 or t.shape != (length,) or not t.is_contiguous():
        raise ValueError(f"{kernel}: {name} must be contiguous int64 of shape ({length},), got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def check_row_view(kernel: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """t [rows, heads, dim] has this shape, heads and dim contiguous, any row stride (a view
    into a fused qkv tensor qualifies)."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{kernel}: {name} must have shape {shape}, got {tuple(t.shape)}")
    # (A size-1 dim's stride never matters: torch leaves it free in views.)
    if (shape[2] > 1 and t.stride(2) != 1) or (shape[1] > 1 and t.stride(1) != shape[2]):
        raise ValueError(f"{kernel}: {name} needs heads and dim contiguous (strides (*, "
                         f"{shape[2]}, 1)), got {t.stride()}")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block lengths must be one."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
