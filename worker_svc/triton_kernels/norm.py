"""Residual add + RMSNorm in one pass, as a Triton kernel.

Every norm of a Llama layer is "add the residual, then RMSNorm" (worker_svc.model.llama); in
torch that is an add, a cast, a square, a mean, an rsqrt and two multiplies, each a kernel
launch reading the row again. Here one program owns one row: it loads x and the residual
once, writes their sum (the new residual stream) and the normed row.

Rounding matches torch: the sum is taken in float32 and rounded once to the dtype, which is
exactly torch's `x + residual` (float32 carries more than twice the bits of float16 or
bfloat16, so rounding twice cannot differ from rounding once); the norm is then computed in
float32 from that rounded sum, times the weight, and rounded once, as
`torch.nn.functional.rms_norm` does on CPU (torch 2.13). `add_rms_norm_reference` is the
torch twin, the tests' oracle.
"""

import torch
import triton
import triton.language as tl

from worker_svc.triton_kernels.checks import (
    check_contiguous,
    check_device,
    check_float,
    next_power_of_2,
)

# A row is one block of registers: the widest hidden size we take (Llama-70B's).
MAX_DIM = 8192


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, new_residual_ptr, normed_ptr, eps,
                         DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    offsets = row * DIM + cols
    h = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    summed = h.to(new_residual_ptr.dtype.element_ty)         # torch's x + residual
    tl.store(new_residual_ptr + offsets, summed, mask=mask)
    h = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / DIM + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + offsets, (h * inv_rms * weight).to(normed_ptr.dtype.element_ty),
             mask=mask)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    name = "add_rms_norm"
    check_float(name, "x", x)
    check_float(name, "weight", weight, x.dtype)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"{name}: expected x [rows, dim] and weight [dim], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] > MAX_DIM:
        raise ValueError(f"{name}: dim {x.shape[1]} is over {MAX_DIM}")
    check_contiguous(name, "x", x)
    check_contiguous(name, "weight", weight)
    if residual is not None:
        check_float(name, "residual", residual, x.dtype)
        check_contiguous(name, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{name}: residual {tuple(residual.shape)} is not x's shape "
                             f"{tuple(x.shape)}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [rows, dim] contiguous (residual None: x alone), weight [dim] ->
    (new_residual = x + residual, normed = RMSNorm(new_residual) * weight), both new tensors
    in x's dtype."""
    _check(x, residual, weight)
    check_device("add_rms_norm", x, weight, *(() if residual is None else (residual,)))
    new_residual, normed = torch.empty_like(x), torch.empty_like(x)
    rows, dim = x.shape
    if rows == 0 or dim == 0:
        return new_residual, normed
    block = next_power_of_2(dim)
    # A warp per 256 elements (8 per thread), 1 to 16 warps.
    num_warps = min(16, max(1, block // 256))
    _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, new_residual,
                                  normed, eps, DIM=dim, BLOCK=block,
                                  HAS_RESIDUAL=residual is not None, num_warps=num_warps)
    return new_residual, normed


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None,
                           weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `add_rms_norm` (the tests' oracle): same arguments and results."""
    _check(x, residual, weight)
    new_residual = x.clone() if residual is None else x + residual
    h = new_residual.float()
    normed = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps) * weight.float()
    return new_residual, normed.to(x.dtype)
