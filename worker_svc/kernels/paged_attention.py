"""`paged_attention.c`: attention for every row of a step (decodes and prefill tokens) read
from the paged blocks where they lie. In torch that needs a gathered copy of every request's
keys and values per layer, padded batches and masks; this is 2-3x faster
(bench/cpu_kernels.py). The torch path is `worker_svc.attention.paged_attention` without a
kernel."""

import ctypes

import torch

from worker_svc.kernels.build import build
from worker_svc.kernels.cpu import CpuLevel

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _lanes(head_dim: int, level: CpuLevel) -> int | None:
    """Floats per vector: the level's register width where the head size allows."""
    for lanes in (16, 8, 4):
        if lanes <= level.lanes and head_dim % lanes == 0:
            return lanes
    return None


class PagedAttentionKernel:
    """`paged_attention.c` for one (head_dim, query heads per KV head, dtype)."""

    __slots__ = ("fn", "head_dim", "group", "dtype")

    def __init__(self, library: ctypes.CDLL, head_dim: int, group: int, dtype: torch.dtype):
        self.fn = library.paged_attention
        self.fn.restype = None
        self.fn.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I,
                            _F, _P]
        self.head_dim, self.group, self.dtype = head_dim, group, dtype

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 row_request: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
        """Write k, v into their slots, then attend. q [rows, num_heads, head_dim], one query
        token per row; k, v [rows, num_kv_heads, head_dim] (rows may be strided; heads and
        dim contiguous); kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
        contiguous; slot_mapping [rows] int64: each row's cache slot; block_tables [requests,
        max_blocks] int64; row_request [rows] int64: each row's request; kv_lens [rows]
        int64: the keys each row attends to (its position + 1). Returns [rows, heads * dim].
        """
        rows, num_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        index_ok = all(t.dtype == torch.int64 and t.shape == (rows,) and t.is_contiguous()
                       for t in (slot_mapping, row_request, kv_lens))
        rows_ok = all(t.dtype == self.dtype and t.stride(2) == 1 and t.stride(1) == head_dim
                      for t in (q, k, v))
        if (head_dim != self.head_dim or num_heads != num_kv_heads * self.group
                or not rows_ok or not index_ok or kv_cache.dtype != self.dtype
                or k.shape != (rows, num_kv_heads, head_dim) or v.shape != k.shape
                or not kv_cache.is_contiguous() or block_tables.dtype != torch.int64
                or not block_tables.is_contiguous()):
            raise ValueError("paged attention kernel: unexpected shapes, strides or dtypes")
        out = torch.empty(rows, num_heads * head_dim, dtype=q.dtype)
        self.fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                slot_mapping.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(),
                block_tables.shape[1], row_request.data_ptr(), kv_lens.data_ptr(), rows,
                num_kv_heads, num_blocks, block_size, head_dim ** -0.5, out.data_ptr())
        return out



def paged_attention_kernel(level: CpuLevel, head_dim: int, group: int, dtype: torch.dtype
                           ) -> PagedAttentionKernel | None:
    """The attention kernel for this shape at this CPU level, or None (use the torch path)."""
    lanes = _lanes(head_dim, level)
    if lanes is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    library = build("paged_attention.c", level, {"HEAD_DIM": head_dim, "GROUP": group,
                                                 "LANES": lanes,
                                                 "ELEM_BF16": int(dtype == torch.bfloat16)})
    return None if library is None else PagedAttentionKernel(library, head_dim, group, dtype)
