"""`paged_attention.c`: attention for every row of a step (decodes and prefill tokens) read
from the paged blocks where they lie. In torch that needs a gathered copy of every request's
keys and values per layer, padded batches and masks; this is 2-3x faster for decodes
(bench/cpu_kernels.py). Its torch twin is `paged_attention_torch.py` (what
`worker_svc.attention.paged_attention` runs without a kernel).

At level amx in bfloat16, `paged_attention_amx.c` does the score and value products on AMX
tiles for every step whose block size is a multiple of 16 (`AmxPagedAttentionKernel`): 1.3-2.7x
the speed of `paged_attention.c` on decodes (64 x 180 keys: at the memory bandwidth) and 3.4-7x
on prefill chunks, faster than torch's SDPA there too; measured on every shape of
bench/cpu_kernels.py, so it takes every step it can.

An 8-bit cache (torch.float8_e4m3fn / float8_e5m2, worker_svc/kernels/kv_quant.py) is a
build of its own (-DKV_FP8): the kernel quantizes the step's K/V as it writes them (the same
bytes as `kv_quant.write_slots`) and widens the bytes it reads, with the kernel's per-tensor
scales; both C kernels take it, the AMX one widening each tile's K and V rows to bfloat16.
Measured (bench/cpu_kernels.py --only fp8, 2 Zen 5 cores, level avx512_bf16, SmolLM2's
shape, 30 layers), fp8 against a cache in the compute dtype: decodes of 64 x 180 keys 0.8x
the time in bfloat16, 0.65x in float32, 1 x 2000 keys 0.88x and 0.72x (half and a quarter
of the bytes to read); a 512-token prefill chunk, bound by arithmetic, 0.98x in bfloat16 and
1.2x in float32 (a float32 row feeds the multiplies as it lies, a byte row is widened first,
for every query row that reads it)."""

import ctypes

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel, request_amx
from worker_svc.kernels.kv_quant import KvScales, is_fp8

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# The C kernels' KV_FP8 define per 8-bit cache dtype (absent: the cache is in the compute dtype)
_KV_FP8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def _lanes(head_dim: int, level: CpuLevel) -> int | None:
    """Floats per vector: the level's register width where the head size allows."""
    for lanes in (16, 8, 4):
        if lanes <= level.lanes and head_dim % lanes == 0:
            return lanes
    return None


class PagedAttentionKernel:
    """`paged_attention.c` for one (head_dim, query heads per KV head, dtype, cache dtype):
    `kv_dtype` is `dtype` or an 8-bit format read and written with `kv_scales`."""

    __slots__ = ("fn", "head_dim", "group", "dtype", "kv_dtype", "kv_scales")

    def __init__(self, library: ctypes.CDLL, head_dim: int, group: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, kv_scales: KvScales | None = None):
        self.fn = library.paged_attention
        self.fn.restype = None
        self.fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I,
                            _I, _F, _F, _F, _P]
        self.head_dim, self.group, self.dtype = head_dim, group, dtype
        self.kv_dtype = kv_dtype or dtype
        # (a cache in the compute dtype is read as stored: its scales are 1)
        self.kv_scales = (kv_scales or KvScales()) if is_fp8(self.kv_dtype) else KvScales()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 row_request: torch.Tensor, kv_lens: torch.Tensor, window: int = 0
                 ) -> torch.Tensor:
        """Write k, v into their slots, then attend. q [rows, num_heads, head_dim], one query
        token per row; k, v [rows, num_kv_heads, head_dim] (rows may be strided; heads and
        dim contiguous); kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
        contiguous, of the kernel's kv_dtype; slot_mapping [rows] int64: each row's cache
        slot; block_tables [requests, max_blocks] int64; row_request [rows] int64: each row's
        request; kv_lens [rows] int64: the keys each row attends to (its position + 1);
        window > 0: only the last `window` of them, and no block wholly before those is read
        (it may be the null block). Returns [rows, heads * dim].
        """
        rows, num_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        index_ok = all(t.dtype == torch.int64 and t.shape == (rows,) and t.is_contiguous()
                       for t in (slot_mapping, row_request, kv_lens))
        rows_ok = all(t.dtype == self.dtype and t.stride(2) == 1 and t.stride(1) == head_dim
                      for t in (q, k, v))
        if (head_dim != self.head_dim or num_heads != num_kv_heads * self.group
                or not rows_ok or not index_ok or kv_cache.dtype != self.kv_dtype
                or k.shape != (rows, num_kv_heads, head_dim) or v.shape != k.shape
                or not kv_cache.is_contiguous() or block_tables.dtype != torch.int64
                or not block_tables.is_contiguous() or window < 0):
            raise ValueError("paged attention kernel: unexpected shapes, strides or dtypes")
        out = torch.empty(rows, num_heads * head_dim, dtype=q.dtype)
        attend = self._pick(rows, block_size)
        attend(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
               slot_mapping.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(),
               block_tables.shape[1], row_request.data_ptr(), kv_lens.data_ptr(), window, rows,
               num_kv_heads, num_blocks, block_size, head_dim ** -0.5, self.kv_scales.k_scale,
               self.kv_scales.v_scale, out.data_ptr())
        return out

    def _pick(self, rows: int, block_size: int) -> ctypes._CFuncPtr:
        """The C entry that attends this step."""
        return self.fn


class AmxPagedAttentionKernel(PagedAttentionKernel):
    """`paged_attention_amx.c` (bfloat16 on AMX tiles) where the step suits it, else
    `paged_attention.c`: same call, same cache effects. The AMX kernel rounds P to bfloat16
    before the value product (the twin keeps float32): against a float32 reference its
    largest difference is the output's own bfloat16 rounding plus at most one ulp, its mean
    difference 1.4x the twin's. It needs 16 keys of a tile in one block (block_size % 16
    == 0); other block sizes go to the twin."""

    __slots__ = ("amx_fn",)

    def __init__(self, library: ctypes.CDLL, amx_library: ctypes.CDLL, head_dim: int,
                 group: int, kv_dtype: torch.dtype | None = None,
                 kv_scales: KvScales | None = None):
        reason = request_amx()
        if reason is not None:
            raise RuntimeError(f"paged_attention_amx: no AMX tiles for this process: {reason}")
        super().__init__(library, head_dim, group, torch.bfloat16, kv_dtype, kv_scales)
        self.amx_fn = amx_library.paged_attention_amx
        self.amx_fn.restype = None
        self.amx_fn.argtypes = self.fn.argtypes

    def _pick(self, rows: int, block_size: int) -> ctypes._CFuncPtr:
        return self.amx_fn if block_size % 16 == 0 else self.fn

    def twin(self) -> PagedAttentionKernel:
        """`paged_attention.c` alone, for the same shape (tests and benchmarks compare)."""
        twin = PagedAttentionKernel.__new__(PagedAttentionKernel)
        twin.fn, twin.head_dim, twin.group, twin.dtype = (self.fn, self.head_dim, self.group,
                                                          self.dtype)
        twin.kv_dtype, twin.kv_scales = self.kv_dtype, self.kv_scales
        return twin


def _amx_fits(level: CpuLevel, head_dim: int, group: int, dtype: torch.dtype) -> bool:
    return (level >= CpuLevel.AMX and dtype == torch.bfloat16 and head_dim % 32 == 0
            and 1 <= group <= 16 and request_amx() is None)


def paged_attention_kernel(level: CpuLevel, head_dim: int, group: int, dtype: torch.dtype,
                           kv_dtype: torch.dtype | None = None,
                           kv_scales: KvScales | None = None) -> PagedAttentionKernel | None:
    """The attention kernel for this shape at this CPU level, or None (use the torch path):
    at level amx in bfloat16 (head_dim a multiple of 32, at most 16 query heads per KV head)
    the AMX kernel, with `paged_attention.c` for the steps it does not take. `kv_dtype`: the
    cache's element type (None: `dtype`; else float8 e4m3fn or e5m2, read and written with
    `kv_scales`, 1.0 each if None)."""
    kv_dtype = kv_dtype or dtype
    if kv_dtype != dtype and kv_dtype not in _KV_FP8:
        return None
    lanes = _lanes(head_dim, level)
    if lanes is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    # (no KV_FP8 for a cache in the compute dtype: the same flags as build.level_builds',
    # so a worker's start-up build is the one the model loads)
    cache = {"KV_FP8": _KV_FP8[kv_dtype]} if kv_dtype in _KV_FP8 else {}
    library = build("paged_attention.c", level, {"HEAD_DIM": head_dim, "GROUP": group,
                                                 "LANES": lanes,
                                                 "ELEM_BF16": int(dtype == torch.bfloat16)}
                    | cache)
    if library is None:
        return None
    if _amx_fits(level, head_dim, group, dtype):
        amx = build("paged_attention_amx.c", level, {"HEAD_DIM": head_dim, "GROUP": group,
                                                     "ELEM_BF16": 1} | cache)
        if amx is not None:
            return AmxPagedAttentionKernel(library, amx, head_dim, group, kv_dtype, kv_scales)
    return PagedAttentionKernel(library, head_dim, group, dtype, kv_dtype, kv_scales)
