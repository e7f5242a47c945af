"""The torch twin of paged_attention.c: attention over the paged KV cache in plain torch,
for level none, shapes no C kernel builds for, and a GPU without Triton; and the slow
token-by-token reference every attention path is tested against.

The C and Triton kernels attend each row straight from its blocks; torch needs a gathered,
padded copy per batch instead. worker_svc.attention builds what these functions take once per
step (the gather rows of each request's blocks and the masks, in its `AttentionMetadata`),
writes the step's K/V and calls `attend_decodes` for the one-token queries and
`attend_prefill_group` per group of longer chunks. Cache layout: worker_svc.attention.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.kernels.kv_quant import KvScales, dequantize, is_fp8, quantize


@dataclass(slots=True)
class PrefillGroup:
    """Consecutive multi-token chunks of the flat batch, attended in one padded SDPA call."""

    token_start: int            # first row of the group in the flat batch
    token_end: int              # one past its last row
    num_chunks: int
    max_query_len: int          # queries are padded to this per chunk
    max_kv_len: int             # keys are padded to this per chunk
    # [token_end - token_start] int64: each token's row in [num_chunks * max_query_len];
    # None when no chunk is padded
    padded_rows: torch.Tensor | None
    # [2 * num_chunks * max_blocks] int64: rows of the keys, then of the values, of the chunks'
    # blocks (padded with block 0; for a sliding window, from the window's first block and
    # padded with the chunk's last) in the cache viewed as [2 * num_blocks, ...]
    gather_rows: torch.Tensor
    # [num_chunks, 1, max_query_len, max_kv_len] bool, True = may attend: bottom-right aligned
    # causal per chunk (padding rows see key 0 only, so that no row is empty). None when every
    # chunk has no context and no padding: then SDPA's own causal mask is the same thing.
    mask: torch.Tensor | None


# From this many one-token queries on, block-diagonal matmuls beat SDPA (measured crossover on
# 2 AVX-512 cores: about 4; at 64 queries they take a third of SDPA's time).
_MIN_DECODES_FOR_MATMUL = 4
# Decodes are attended in sub-batches whose gathered K/V stay under this size: past glibc's
# largest mmap threshold (32 MiB) every gather pays fresh page faults (measured 4x slower
# at 64 requests x 1000 tokens).
_MAX_DECODE_GATHER_BYTES = 16 << 20


def _dequantized(gathered: torch.Tensor, scales: KvScales | None, dtype: torch.dtype
                 ) -> torch.Tensor:
    """Gathered rows of an 8-bit cache, keys then values ([2 * n, ...]), as `dtype`."""
    if not is_fp8(gathered.dtype):
        return gathered
    scales = scales or KvScales()
    keys, values = gathered.view(2, -1, *gathered.shape[1:])
    return torch.stack([dequantize(keys, scales.k_scale, dtype),
                        dequantize(values, scales.v_scale, dtype)]).view(-1, *gathered.shape[1:])


def attend_decodes(q: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor,
                   bias: torch.Tensor, mask: torch.Tensor, num_kv_heads: int,
                   scales: KvScales | None = None) -> torch.Tensor:
    """One-token queries q [num_decodes, heads, dim] -> [num_decodes, heads * dim].

    Few queries: SDPA, with the query heads that share a KV head as that head's query rows
    (GQA as plain attention over num_kv_heads heads; no mask row differs within a request).
    Many: queries go in block-diagonal form, row h of a request holding q[h] in the columns
    of h's KV head and zeros elsewhere, so one batched matmul against the gathered keys of all
    KV heads, laid out as stored ([kv_len, kv_heads * dim]: no transposing copy), yields every
    head's scores, and one more the outputs. That costs num_kv_heads times the minimal flops,
    but decode attention is bound by reading K/V and by per-kernel overhead (64 requests x 200
    tokens: 0.66 vs 1.2 ms a layer, measured). An 8-bit cache's rows are dequantized with
    `scales` after the gather.
    """
    num_decodes = q.shape[0]
    num_key_rows = rows.shape[0] // 2                   # keys first, then values
    rows_per_decode = num_key_rows // num_decodes
    bytes_per_decode = 2 * rows_per_decode * blocks.shape[1] * blocks.element_size()
    step = max(1, _MAX_DECODE_GATHER_BYTES // bytes_per_decode)
    if step >= num_decodes:
        return _decode_sub_batch(q, blocks, rows, bias, mask, num_kv_heads, scales)
    outputs = []
    for lo in range(0, num_decodes, step):
        hi = min(lo + step, num_decodes)
        key_rows = rows[lo * rows_per_decode:hi * rows_per_decode]
        value_rows = rows[num_key_rows + lo * rows_per_decode:num_key_rows + hi * rows_per_decode]
        outputs.append(_decode_sub_batch(q[lo:hi], blocks, torch.cat([key_rows, value_rows]),
                                         bias[lo:hi], mask[lo:hi], num_kv_heads, scales))
    return torch.cat(outputs)


def _decode_sub_batch(q: torch.Tensor, blocks: torch.Tensor, gather_rows: torch.Tensor,
                      bias: torch.Tensor, mask: torch.Tensor, num_kv_heads: int,
                      scales: KvScales | None) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    width = num_kv_heads * head_dim
    # [2 * decodes * blocks, block elements]
    gathered = _dequantized(blocks.index_select(0, gather_rows), scales, q.dtype)
    keys, values = gathered.view(2, num_decodes, -1, width)     # [decodes, kv_len, width] each
    if num_decodes < _MIN_DECODES_FOR_MATMUL:
        out = F.scaled_dot_product_attention(
            q.view(num_decodes, num_kv_heads, group, head_dim),
            keys.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2),
            values.view(num_decodes, -1, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=mask)                               # [decodes, kv_heads, group, dim]
        return out.reshape(num_decodes, num_heads * head_dim)
    q_diag = q.new_zeros(num_decodes, num_heads, width)               # [decodes, heads, width]
    # Diagonal view [decodes, group, dim, kv_heads]: query head (g_kv, r) -> KV head g_kv.
    q_diag.view(num_decodes, num_kv_heads, group, num_kv_heads, head_dim).diagonal(
        dim1=1, dim2=3).copy_(q.view(num_decodes, num_kv_heads, group, head_dim)
                              .permute(0, 2, 3, 1))
    scores = torch.bmm(q_diag, keys.transpose(1, 2))                # [decodes, heads, kv_len]
    # Softmax in float32 (the bias is float32, so the add promotes), padding at -inf. (In
    # bfloat16 the scores are rounded to bfloat16 first, as in HF's eager attention.)
    probs = torch.softmax(torch.add(bias, scores, alpha=head_dim ** -0.5), dim=-1)
    out = torch.bmm(probs.to(q.dtype), values)                      # [decodes, heads, width]
    out = out.view(num_decodes, num_kv_heads, group, num_kv_heads, head_dim).diagonal(
        dim1=1, dim2=3)                                             # [decodes, group, dim, kv]
    return out.permute(0, 3, 1, 2).reshape(num_decodes, num_heads * head_dim)


def attend_prefill_group(q: torch.Tensor, blocks: torch.Tensor, group: PrefillGroup,
                         num_kv_heads: int, scales: KvScales | None = None) -> torch.Tensor:
    """A group's queries q [num_group_tokens, heads, dim] -> [num_group_tokens, heads * dim]."""
    _, num_heads, head_dim = q.shape
    chunks, max_q, max_kv = group.num_chunks, group.max_query_len, group.max_kv_len
    if group.padded_rows is not None:
        q = q.new_zeros(chunks * max_q, num_heads, head_dim).index_copy_(0, group.padded_rows, q)
    q = q.view(chunks, max_q, num_heads, head_dim).transpose(1, 2)  # [chunks, heads, q, dim]
    gathered = (_dequantized(blocks.index_select(0, group.gather_rows), scales, q.dtype)
                .view(2, chunks, -1, num_kv_heads, head_dim))
    keys = gathered[0, :, :max_kv].transpose(1, 2)     # [chunks, kv_heads, kv_len, dim]
    values = gathered[1, :, :max_kv].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask,
                                         is_causal=group.mask is None, enable_gqa=True)
    out = out.transpose(1, 2).reshape(chunks * max_q, num_heads * head_dim)
    return out if group.padded_rows is None else out.index_select(0, group.padded_rows)


def reference_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              kv_cache: torch.Tensor, query_lens: list[int],
                              context_lens: list[int], block_tables: list[list[int]],
                              window: int = 0, scales: KvScales | None = None
                              ) -> torch.Tensor:
    """Slow twin of `paged_attention`: token by token, explicit softmax in float32.

    Requests may come in any order. Same shapes and cache effects as `paged_attention`;
    `window` > 0: a row of L keys reads only keys max(0, L - window) .. L - 1. An 8-bit cache
    is written and read through worker_svc.kernels.kv_quant with `scales`.
    """
    fp8 = is_fp8(kv_cache.dtype)
    scales = scales or KvScales()
    # (CPU torch cannot assign into float8 tensors: their bytes are written)
    store = kv_cache.view(torch.uint8) if fp8 else kv_cache

    def stored(x: torch.Tensor, scale: float) -> torch.Tensor:
        return quantize(x, scale, kv_cache.dtype).view(torch.uint8) if fp8 else x

    def read(x: torch.Tensor, scale: float) -> torch.Tensor:
        return dequantize(x, scale, torch.float32) if fp8 else x.float()

    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads

    def slot_of(table: list[int], pos: int) -> tuple[int, int]:
        return table[pos // block_size], pos % block_size

    row = 0
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        for i in range(q_len):
            block, offset = slot_of(table, ctx + i)
            store[0, block, offset] = stored(k[row + i], scales.k_scale)
            store[1, block, offset] = stored(v[row + i], scales.v_scale)
        row += q_len

    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    row = 0
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        for i in range(q_len):
            first = max(0, ctx + i + 1 - window) if window else 0
            visible = [slot_of(table, pos) for pos in range(first, ctx + i + 1)]
            keys = read(torch.stack([kv_cache[0, b, o] for b, o in visible]),  # [n, kvh, d]
                        scales.k_scale)
            values = read(torch.stack([kv_cache[1, b, o] for b, o in visible]), scales.v_scale)
            for h in range(num_heads):
                scores = keys[:, h // group] @ q[row + i, h].float() / math.sqrt(head_dim)
                weights = torch.softmax(scores, dim=0)                           # [n]
                out[row + i, h * head_dim:(h + 1) * head_dim] = weights @ values[:, h // group]
        row += q_len
    return out
