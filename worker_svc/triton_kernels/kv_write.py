"""Writing a step's new keys and values into the paged KV cache, as a Triton kernel, and the
8-bit cache formats' encoding and decoding that the attention kernels share.

Every layer calls this before attention (`paged_attention_with_write`), so that the attention
reads each row's keys, its own included, from the cache only. A row's K (and V) is
`num_kv_heads * head_dim` contiguous elements, and so is a cache slot (layout
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, see worker_svc.attention): the write is
one contiguous copy per row, split across programs of `BLOCK` elements each.

A negative slot skips its row: CUDA graphs run at fixed batch sizes, and their padding rows
must not touch the cache. Slots are int64 and every cache offset is computed in int64 (a
cache can pass 2^31 elements). `write_kv_reference` is the torch twin, the tests' oracle.

An fp8 cache (torch.float8_e4m3fn or float8_e5m2, worker_svc.kernels.kv_quant) is handed to
the kernels as its bytes (uint8), and they encode and decode with integer bit operations,
not Triton's own fp8 casts: Triton 3.9's CPU interpreter truncates where torch rounds to
nearest even (348 of 1,024 values drawn from N(0, 0.01^2) got another e4m3 byte) and does
not saturate (-600 became -288), so its casts cannot be checked here. What runs on Hopper is
this same code (no Triton fp8 cast anywhere), compiled: it gives torch's bytes exactly
(tests/worker_svc/test_triton_fp8.py, which also compiles it for sm_90 on the CPU).
`kv_format` gives a kernel the cache's bytes and format.
"""

import torch
import triton
import triton.language as tl

from worker_svc.kernels.kv_quant import FP8_MAX, KvScales, is_fp8, write_slots
from worker_svc.triton_kernels.checks import (
    check_contiguous,
    check_device,
    check_float,
    check_index,
    check_kv_cache_dtype,
    check_row_view,
    next_power_of_2,
)

# Largest number of elements one program copies (more rows' worth run as more programs).
_MAX_BLOCK = 1024
# Mantissa bits of each 8-bit format: the kernels' `KV_MANT` (0: the cache is the compute dtype)
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def kv_format(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """(the cache as the kernels take it, KV_MANT, KV_MAX): an 8-bit cache as its bytes with
    its format's mantissa bits and largest finite value; any other as it is, 0 and 0.0."""
    if not is_fp8(kv_cache.dtype):
        return kv_cache, 0, 0.0
    return kv_cache.view(torch.uint8), _MANTISSA_BITS[kv_cache.dtype], FP8_MAX[kv_cache.dtype]


def fp8_read_factor(kv_cache: torch.Tensor) -> float:
    """What `fp8_to_half`'s values must be multiplied by: 256 for e4m3 (its values are held
    as float16 values / 256), 1 otherwise. The launchers fold it into the scales."""
    return 256.0 if kv_cache.dtype == torch.float8_e4m3fn else 1.0


@triton.jit
def fp8_encode(x, KV_MANT: tl.constexpr, KV_MAX: tl.constexpr):
    """float32 x (already divided by its scale) -> the 8-bit format's bytes (uint8):
    saturated to +-KV_MAX (infinities too), rounded to nearest even, NaN as 0x7f | sign, as
    torch's `x.clamp(-max, max).to(float8)` does."""
    SHIFT: tl.constexpr = 23 - KV_MANT                       # float32 mantissa bits dropped
    BIAS: tl.constexpr = (1 << (6 - KV_MANT)) - 1            # 7 (e4m3) or 15 (e5m2)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), KV_MAX).to(tl.uint32, bitcast=True)
    # Normal: rebias the exponent, then round the dropped bits to nearest even (a carry
    # into the exponent is the right result; a <= KV_MAX never rounds past it).
    normal = (a - ((127 - BIAS) << 23) + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT
    # Subnormal (a below 2^(1 - BIAS)): the 24-bit significand shifted down to units of the
    # smallest subnormal, rounded to nearest even; shifts past 31 (tiny a, zero) give 0.
    exponent = a >> 23
    significand = (a & 0x7FFFFF) | 0x800000
    shift = (127 - BIAS + SHIFT + 1) - exponent.to(tl.int32)        # > SHIFT where used
    shift = tl.minimum(tl.maximum(shift, 1), 31).to(tl.uint32)
    half = (tl.full(shift.shape, 1, tl.uint32) << (shift - 1)) - 1
    subnormal = (significand + half + ((significand >> shift) & 1)) >> shift
    code = tl.where(exponent < 128 - BIAS, subnormal, normal)
    code = tl.where(x != x, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def fp8_to_half(b, KV_MANT: tl.constexpr):
    """Bytes (uint8) of the 8-bit format -> float16, exactly: e5m2 is float16's top byte;
    e4m3's sign, exponent and mantissa land in float16's fields with its exponent bias 8 too
    small, so the value comes out / 256 (subnormals too) and the caller multiplies by 256
    (`fp8_read_factor`, folded into a scale). e4m3's NaN (0x7f | sign) reads as NaN."""
    h = b.to(tl.uint16)
    if KV_MANT == 2:
        x = (h << 8).to(tl.float16, bitcast=True)
    else:
        x = (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)
        x = tl.where((h & 0x7F) == 0x7F, float("nan"), x)
    return x


@triton.jit
def _write_kv_kernel(k_ptr, k_row_stride, v_ptr, v_row_stride, key_cache_ptr, value_cache_ptr,
                     slot_mapping_ptr, k_scale, v_scale, WIDTH: tl.constexpr,
                     BLOCK: tl.constexpr, KV_MANT: tl.constexpr, KV_MAX: tl.constexpr):
    # Program (row, part): elements [part * BLOCK, (part + 1) * BLOCK) of row's K and V.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + row)                  # int64; < 0: padding row
    # Columns to copy: none for a skipped row. (Not `(cols < WIDTH) & (slot >= 0)`: Triton
    # 3.9's interpreter rejects a mask made of a block and a scalar.)
    mask = cols < tl.where(slot >= 0, WIDTH, 0)
    k = tl.load(k_ptr + row * k_row_stride + cols, mask=mask)
    v = tl.load(v_ptr + row * v_row_stride + cols, mask=mask)
    if KV_MANT > 0:
        # x / scale correctly rounded (Triton's `/` is approximate on CUDA), as kv_quant does
        k = fp8_encode(tl.math.div_rn(k.to(tl.float32), k_scale), KV_MANT, KV_MAX)
        v = fp8_encode(tl.math.div_rn(v.to(tl.float32), v_scale), KV_MANT, KV_MAX)
    dest = slot * WIDTH + cols                               # int64, as slot is
    tl.store(key_cache_ptr + dest, k, mask=mask)
    tl.store(value_cache_ptr + dest, v, mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    name = "write_kv"
    check_kv_cache_dtype(name, kv_cache)
    check_contiguous(name, "kv_cache", kv_cache)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    if k.dim() != 3:
        raise ValueError(f"{name}: k must be [rows, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)}")
    shape = (k.shape[0], kv_cache.shape[3], kv_cache.shape[4])
    for label, t in (("k", k), ("v", v)):
        check_float(name, label, t, None if is_fp8(kv_cache.dtype) else kv_cache.dtype)
        check_row_view(name, label, t, shape)
    if k.dtype != v.dtype:
        raise ValueError(f"{name}: k is {k.dtype} and v {v.dtype}")
    check_index(name, "slot_mapping", slot_mapping, k.shape[0])


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: KvScales | None = None) -> None:
    """Copy k, v [rows, num_kv_heads, head_dim] (any row stride; heads and dim contiguous)
    into kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous) at
    slot_mapping [rows] (int64, block_id * block_size + offset; negative = skip the row).
    A float8 cache stores each value quantized with `scales` (kv_quant.quantize's bytes).
    Slots are not range-checked (that would cost a device sync)."""
    _check(k, v, kv_cache, slot_mapping)
    check_device("write_kv", k, v, kv_cache, slot_mapping)
    rows, num_kv_heads, head_dim = k.shape
    width = num_kv_heads * head_dim
    if rows == 0 or width == 0:
        return
    scales = scales or KvScales()
    cache, kv_mant, kv_max = kv_format(kv_cache)
    block = min(next_power_of_2(width), _MAX_BLOCK)
    grid = (rows, triton.cdiv(width, block))
    _write_kv_kernel[grid](k, k.stride(0), v, v.stride(0), cache[0], cache[1], slot_mapping,
                           scales.k_scale, scales.v_scale, WIDTH=width, BLOCK=block,
                           KV_MANT=kv_mant, KV_MAX=kv_max)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, scales: KvScales | None = None) -> None:
    """Torch twin of `write_kv` (the tests' oracle): same arguments, same cache effect."""
    _check(k, v, kv_cache, slot_mapping)
    keep = slot_mapping >= 0
    write_slots(kv_cache, slot_mapping[keep], k[keep], v[keep], scales)
