"""The KV cache's element type (`--kv-cache-dtype`, vLLM's names and meaning) and its 8-bit
formats' quantization: the reference every attention path (C, AMX, Triton, the torch twin)
writes and reads by.

`auto` stores K/V in the compute dtype. `fp8` (= `fp8_e4m3`) and `fp8_e5m2` store each element
in one byte, as torch.float8_e4m3fn / torch.float8_e5m2, with one scale per tensor for keys
and one for values, as vLLM does by default: stored = saturate(x / scale), read = stored *
scale. A decode step reads its whole context's K/V, so this halves (bfloat16) or quarters
(float32) the bytes attention reads, and doubles or quadruples the blocks a memory budget
holds.

Scales are 1.0 (vLLM's default where a checkpoint carries none; none of the formats we load
does). e4m3 keeps 3 mantissa bits over +-448 (subnormals from 2^-9), e5m2 2 bits over +-57344
(subnormals from 2^-16): the keys and values of the models we serve stay well inside either
range, and the accuracy this costs is measured by tests/worker_svc/test_kv_fp8_accuracy.py.

Rounding is to nearest, ties to even, after saturating to the format's largest finite value
(torch's own conversion, which the C and Triton writers reproduce bit for bit).
"""

from dataclasses import dataclass

import torch

# --kv-cache-dtype values -> the storage dtype (None: the compute dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of a `--kv-cache-dtype` name for a replica computing in
    `compute_dtype`. ValueError names the accepted values."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"not {name!r}")
    return KV_CACHE_DTYPES[name] or compute_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@dataclass(frozen=True, slots=True)
class KvScales:
    """The per-tensor scales of an 8-bit cache: x = stored * scale."""

    k_scale: float = 1.0
    v_scale: float = 1.0

    def describe(self) -> str:
        """For the KV store's chunk names: chunks saved under other scales never match."""
        return f"k{self.k_scale:.9g}v{self.v_scale:.9g}"


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) as `dtype` (float8): x / scale, saturated, rounded to nearest even.
    The division is in float32, as every kernel does it."""
    limit = FP8_MAX[dtype]
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored float8 values back as `dtype` (float32 arithmetic, rounded once to dtype)."""
    values = x.float()
    if scale != 1.0:
        values *= scale
    return values.to(dtype)


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scales: KvScales | None = None) -> None:
    """The torch twin of every kernel's KV write: rows of k, v ([tokens, kv_heads, dim]) into
    their slots of `cache` ([2, num_blocks, block_size, kv_heads, dim]), quantized where the
    cache is float8 (CPU torch has no index_copy_ for float8: its bytes are copied)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    slots = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if not is_fp8(cache.dtype):
        slots[0].index_copy_(0, slot_mapping, k)
        slots[1].index_copy_(0, slot_mapping, v)
        return
    scales = scales or KvScales()
    raw = slots.view(torch.uint8)
    raw[0].index_copy_(0, slot_mapping,
                       quantize(k, scales.k_scale, cache.dtype).view(torch.uint8))
    raw[1].index_copy_(0, slot_mapping,
                       quantize(v, scales.v_scale, cache.dtype).view(torch.uint8))
