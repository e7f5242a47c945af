"""Writing a step's new keys and values into the paged KV cache, as a Triton kernel.

Every layer calls this before attention (`paged_attention_with_write`), so that the attention
reads each row's keys, its own included, from the cache only. A row's K (and V) is
`num_kv_heads * head_dim` contiguous elements, and so is a cache slot (layout
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, see worker_svc.attention): the write is
one contiguous copy per row, split across programs of `BLOCK` elements each.

A negative slot skips its row: CUDA graphs run at fixed batch sizes, and their padding rows
must not touch the cache. Slots are int64 and every cache offset is computed in int64 (a
cache can pass 2^31 elements). `write_kv_reference` is the torch twin, the tests' oracle.
"""

import torch
import triton
import triton.language as tl

from worker_svc.triton_kernels.checks import (
    check_contiguous,
    check_device,
    check_float,
    check_index,
    check_row_view,
    next_power_of_2,
)

# Largest number of elements one program copies (more rows' worth run as more programs).
_MAX_BLOCK = 1024


@triton.jit
def _write_kv_kernel(k_ptr, k_row_stride, v_ptr, v_row_stride, key_cache_ptr, value_cache_ptr,
                     slot_mapping_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, part): elements [part * BLOCK, (part + 1) * BLOCK) of row's K and V.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + row)                  # int64; < 0: padding row
    # Columns to copy: none for a skipped row. (Not `(cols < WIDTH) & (slot >= 0)`: Triton
    # 3.9's interpreter rejects a mask made of a block and a scalar.)
    mask = cols < tl.where(slot >= 0, WIDTH, 0)
    k = tl.load(k_ptr + row * k_row_stride + cols, mask=mask)
    v = tl.load(v_ptr + row * v_row_stride + cols, mask=mask)
    dest = slot * WIDTH + cols                               # int64, as slot is
    tl.store(key_cache_ptr + dest, k, mask=mask)
    tl.store(value_cache_ptr + dest, v, mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    name = "write_kv"
    check_float(name, "kv_cache", kv_cache)
    check_contiguous(name, "kv_cache", kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    if k.dim() != 3:
        raise ValueError(f"{name}: k must be [rows, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)}")
    shape = (k.shape[0], kv_cache.shape[3], kv_cache.shape[4])
    for label, t in (("k", k), ("v", v)):
        check_float(name, label, t, kv_cache.dtype)
        check_row_view(name, label, t, shape)
    check_index(name, "slot_mapping", slot_mapping, k.shape[0])


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Copy k, v [rows, num_kv_heads, head_dim] (any row stride; heads and dim contiguous)
    into kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous) at
    slot_mapping [rows] (int64, block_id * block_size + offset; negative = skip the row).
    Slots are not range-checked (that would cost a device sync)."""
    _check(k, v, kv_cache, slot_mapping)
    check_device("write_kv", k, v, kv_cache, slot_mapping)
    rows, num_kv_heads, head_dim = k.shape
    width = num_kv_heads * head_dim
    if rows == 0 or width == 0:
        return
    block = min(next_power_of_2(width), _MAX_BLOCK)
    grid = (rows, triton.cdiv(width, block))
    _write_kv_kernel[grid](k, k.stride(0), v, v.stride(0), kv_cache[0], kv_cache[1],
                           slot_mapping, WIDTH=width, BLOCK=block)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Torch twin of `write_kv` (the tests' oracle): same arguments, same cache effect."""
    _check(k, v, kv_cache, slot_mapping)
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots[0].index_copy_(0, slot_mapping[keep], k[keep])
    slots[1].index_copy_(0, slot_mapping[keep], v[keep])
