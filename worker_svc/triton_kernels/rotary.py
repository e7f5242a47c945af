"""Rotary position embedding (RoPE), in place, as a Triton kernel.

The model rotates q and k inside the fused qkv tensor, one call per layer for the first
`num_heads + num_kv_heads` heads of each row (worker_svc.model.llama: `RotaryEmbedding`,
`apply_rotary`, `TorchElementwise.rotary_`). The convention is HF's non-interleaved one:
dimension i pairs with i + head_dim/2, and the sin table has its first half negated, so that

    out = x * cos[pos] + roll(x, head_dim/2) * sin[pos]

In halves, with x = (x1, x2): out1 = x1 * cos1 + x2 * sin1, out2 = x2 * cos2 + x1 * sin2. A
program loads both halves of a few heads of one row and the row's table entries once, and
computes in float32 (the torch path rounds each product to the dtype: results agree to a
rounding). `rotary_reference_` is the torch twin, equal to `TorchElementwise.rotary_`.
"""

import torch
import triton
import triton.language as tl

from worker_svc.triton_kernels.checks import (
    check_contiguous,
    check_device,
    check_float,
    check_index,
    next_power_of_2,
)

# Elements of one half-head tile [heads, head_dim / 2] a program holds.
_TILE_ELEMENTS = 2048


@triton.jit
def _rotary_kernel(x_ptr, x_row_stride, positions_ptr, cos_ptr, sin_ptr,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   HALF_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    # Program (row, part): heads [part * HEADS_BLOCK, (part + 1) * HEADS_BLOCK) of the row.
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    mask = (heads < NUM_HEADS)[:, None] & col_ok[None, :]
    table = tl.load(positions_ptr + row) * HEAD_DIM + cols  # int64: the position's entries
    cos1 = tl.load(cos_ptr + table, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + table + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + table + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    first = x_ptr + row * x_row_stride + heads[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)   # [HEADS_BLOCK, HALF_PAD]
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # roll(x, half) brings the second half to the front: x2 meets sin1, x1 meets sin2.
    tl.store(first, (x1 * cos1 + x2 * sin1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor) -> None:
    name = "rotary_"
    check_float(name, "x", x)
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{name}: x must be [rows, width] with contiguous rows, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if head_dim <= 0 or head_dim % 2 or num_heads < 0 or x.shape[1] < num_heads * head_dim:
        raise ValueError(f"{name}: {num_heads} heads of even head_dim {head_dim} must fit in "
                         f"x's width {x.shape[1]}")
    check_index(name, "positions", positions, x.shape[0])
    for label, table in (("cos", cos), ("sin", sin)):
        check_float(name, label, table, x.dtype)
        check_contiguous(name, label, table)
        if table.dim() != 2 or table.shape[1] != head_dim:
            raise ValueError(f"{name}: {label} must be [max_positions, {head_dim}], got "
                             f"{tuple(table.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"{name}: sin {tuple(sin.shape)} and cos {tuple(cos.shape)} differ")


def rotary_(x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first `num_heads` heads of each row of x [rows, width >=
    num_heads * head_dim] (any row stride; rows contiguous) by the cos / signed-sin tables
    [max_positions, head_dim] (x's dtype) at positions [rows] (int64; not range-checked)."""
    _check(x, num_heads, head_dim, positions, cos, sin)
    check_device("rotary_", x, positions, cos, sin)
    rows = x.shape[0]
    if rows == 0 or num_heads == 0:
        return
    half_pad = next_power_of_2(head_dim // 2)
    heads_block = min(next_power_of_2(num_heads), max(1, _TILE_ELEMENTS // half_pad))
    grid = (rows, triton.cdiv(num_heads, heads_block))
    _rotary_kernel[grid](x, x.stride(0), positions, cos, sin, NUM_HEADS=num_heads,
                         HEAD_DIM=head_dim, HALF=head_dim // 2, HALF_PAD=half_pad,
                         HEADS_BLOCK=heads_block)


def rotary_reference_(x: torch.Tensor, num_heads: int, head_dim: int,
                      positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Torch twin of `rotary_` (the tests' oracle), computing as the model's torch path does
    (`TorchElementwise.rotary_`): in x's dtype, rounding each product."""
    _check(x, num_heads, head_dim, positions, cos, sin)
    heads = x[:, :num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
    cos_rows = cos.index_select(0, positions).unsqueeze(1)    # [rows, 1, head_dim]
    sin_rows = sin.index_select(0, positions).unsqueeze(1)
    heads.copy_(torch.addcmul(heads * cos_rows, heads.roll(head_dim // 2, dims=-1), sin_rows))
