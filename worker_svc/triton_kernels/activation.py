"""SiLU-and-multiply, the Llama MLP's activation, as a Triton kernel.

gate and up come out of one fused matmul as the two halves of each row; torch would slice,
apply SiLU, round, multiply and round again. Here a program reads a slice of both halves of
one row, computes silu(gate) * up in float32 and rounds once. `silu_mul_reference` is the
torch twin, the tests' oracle.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker_svc.triton_kernels.checks import (
    check_contiguous,
    check_device,
    check_float,
    next_power_of_2,
)

# Largest number of outputs one program computes (wider rows run as more programs).
_MAX_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, part): outputs [part * BLOCK, (part + 1) * BLOCK) of the row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate_ptr = gate_up_ptr + row * (2 * INTER) + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + INTER, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * INTER + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(gate_up: torch.Tensor) -> None:
    name = "silu_mul"
    check_float(name, "gate_up", gate_up)
    check_contiguous(name, "gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{name}: gate_up must be [rows, 2 * inter], got "
                         f"{tuple(gate_up.shape)}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] contiguous (gate, then up) -> silu(gate) * up, [rows, inter]
    in gate_up's dtype, computed in float32."""
    _check(gate_up)
    check_device("silu_mul", gate_up)
    rows, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(rows, inter)
    if rows == 0 or inter == 0:
        return out
    block = min(next_power_of_2(inter), _MAX_BLOCK)
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, INTER=inter, BLOCK=block)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch twin of `silu_mul` (the tests' oracle): same argument and result."""
    _check(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)
