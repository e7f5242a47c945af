"""Paged attention: each step's metadata, and the dispatch of a layer's attention to its
kernel (C, AMX or Triton, from worker_svc.kernels / worker_svc.triton_kernels) or to the torch
twin (worker_svc.kernels.paged_attention_torch, which also holds the slow reference).

KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). A token's slot is `block_id * block_size + position % block_size`
with `block_id = block_ids[position // block_size]`; viewed as `[2, num_slots, kv_heads, dim]`
a slot is one row, so writing a step's K/V is one `index_copy_` per K and V; viewed as
`[2 * num_blocks, block_size * kv_heads * dim]` a block's keys are row `block_id` and its values
row `num_blocks + block_id`, so gathering requests' K and V is one `index_select` of rows.
Block 0 is the null block: never written by real tokens, used as padding in block tables (its
keys are always masked out).

Each layer first writes the K/V of every new token of the batch, then reads K/V for attention
from the cache only, so a request can use blocks another request wrote in the same step.

The batch is flat: `num_tokens` rows, requests one after another, every one-token query
("decode", including a one-token prefill chunk) before any longer chunk.

Where the C kernel builds (worker_svc.kernels, the default), it attends every row in one call
per layer: a row is a one-token query over its request's first `position + 1` keys, read
from the blocks in place, so causal masking is only each row's length (it also writes the
step's K/V). Without the kernel the torch path runs (its metadata is built only when
`torch_path=True`): decodes run together over their padded, gathered K/V (see
paged_attention_torch.attend_decodes); longer chunks run in groups of
similar sizes, one padded SDPA call per group, with a bottom-right aligned causal mask (query
i of a chunk starting at context length c sees keys 0..c+i).

Sliding window (`window` > 0, per layer): a row of L keys attends keys [max(0, L - W), L) (the
query at position p sees p-W+1 .. p); window 0 attends them all. The kernels take the window
as an argument and skip every block wholly before a row's start. The torch path gathers each
request's blocks from its first row's window start only, padded with a block of the same
request (never the null block: kvcache_svc may free blocks before the window and leave the
null block there, whose contents are garbage, and 0 * NaN is NaN); those gather rows and
masks depend on the window, so they are built on a layer's first use of a window and kept in
the metadata for the step's other layers (`WindowedTorchPath`).

`AttentionMetadata` is built once per step by `build_attention_metadata`; layers only index.
With KV groups (services.kv_groups) each group has its own block tables, so its own metadata:
`build_group_metadata` builds them, sharing positions and row tensors on the kernel path.
A runner on the kernel path builds its step's metadata with `build_kernel_metadata` instead:
numpy over the input batch's persistent block tables (worker_svc.block_tables), no Python
list per row and no torch op on the host (small torch ops wake the intra-op threads, which
then spin: 0.3-0.6 ms of CPU a step where the numpy twin takes a few tens of microseconds).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_svc.kernels import PagedAttentionKernel
from worker_svc.kernels.kv_quant import KvScales, write_slots
from worker_svc.kernels.paged_attention_torch import (
    PrefillGroup,
    attend_decodes,
    attend_prefill_group,
)


@dataclass(slots=True)
class WindowedTorchPath:
    """The torch path's gather rows and masks for one sliding window: the fields of the same
    names in AttentionMetadata, over the blocks from each request's window start."""

    decode_gather_rows: torch.Tensor
    decode_bias: torch.Tensor
    decode_mask: torch.Tensor
    prefill_groups: list[PrefillGroup]


@dataclass(slots=True)
class AttentionMetadata:
    """Where every token of one step goes in the cache and what it attends to."""

    block_size: int                  # tokens per block
    positions: torch.Tensor          # [num_tokens] int64: position in its request (RoPE too)
    slot_mapping: torch.Tensor       # [num_tokens] int64: cache slot each new token's K/V fills
    num_decodes: int                 # rows 0..num_decodes-1 are one-token queries
    # [2 * num_decodes * max_decode_blocks] int64: rows of the keys, then of the values, of the
    # decodes' blocks (padded with block 0) in the cache viewed as [2 * num_blocks, ...]
    decode_gather_rows: torch.Tensor
    # [num_decodes, 1, max_decode_blocks * block_size] float32: 0 for a request's keys,
    # -inf for padding
    decode_bias: torch.Tensor
    decode_mask: torch.Tensor        # [num_decodes, 1, 1, same] bool: True for a request's keys
    # For the C kernel (worker_svc.kernels), which takes every row as a one-token query:
    block_table: torch.Tensor        # [num_reqs, max_blocks] int64, 0-padded
    row_request: torch.Tensor        # [num_tokens] int64: each row's request (table row)
    row_kv_lens: torch.Tensor        # [num_tokens] int64: keys each row sees (position + 1)
    prefill_groups: list[PrefillGroup]  # the longer chunks, in row order after the decodes
    # What the torch path's windowed masks are built from (empty with torch_path=False):
    num_blocks: int = 0                                             # blocks in the cache
    query_lens: list[int] = field(default_factory=list)             # per request, in order
    context_lens: list[int] = field(default_factory=list)           # per request, in order
    # The torch path's per-window gather rows and masks, built on first use (window > 0)
    windows: dict[int, WindowedTorchPath] = field(default_factory=dict)


def metadata_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """`meta` with every tensor moved to `device` (built on the host, used on a GPU)."""
    if device.type == "cpu":
        return meta

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    groups = [_group_to(g, device) for g in meta.prefill_groups]
    return AttentionMetadata(meta.block_size, move(meta.positions), move(meta.slot_mapping),
                             meta.num_decodes, move(meta.decode_gather_rows),
                             move(meta.decode_bias), move(meta.decode_mask),
                             move(meta.block_table), move(meta.row_request),
                             move(meta.row_kv_lens), groups, meta.num_blocks,
                             meta.query_lens, meta.context_lens)


def _group_to(group: PrefillGroup, device: torch.device) -> PrefillGroup:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return PrefillGroup(group.token_start, group.token_end, group.num_chunks,
                        group.max_query_len, group.max_kv_len, move(group.padded_rows),
                        move(group.gather_rows), move(group.mask))


def build_group_metadata(query_lens: list[int], context_lens: list[int],
                         group_tables: Sequence[list[list[int]]], block_size: int,
                         num_blocks: int, device: torch.device,
                         torch_path: bool = True) -> list[AttentionMetadata]:
    """One `build_attention_metadata` per KV group (`group_tables[g]`: every request's table
    in group g), on `device`. On the kernel path (`torch_path=False`) the groups differ only
    in their block table and slots: the first group's positions and row tensors serve all."""
    host = build_attention_metadata(query_lens, context_lens, group_tables[0], block_size,
                                    num_blocks, torch_path)
    first = metadata_to(host, device)
    if len(group_tables) == 1:
        return [first]
    if torch_path:
        return [first] + [metadata_to(build_attention_metadata(
            query_lens, context_lens, tables, block_size, num_blocks, True), device)
            for tables in group_tables[1:]]
    needs = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens, strict=True)]
    width = host.block_table.shape[1]
    metas = [first]
    for tables in group_tables[1:]:
        for t, need in zip(tables, needs, strict=True):
            if len(t) < need:
                raise ValueError(f"block table of {len(t)} blocks cannot hold {need} blocks")
        table = torch.tensor([t[:need] + [0] * (width - need) for t, need in zip(tables, needs)],
                             dtype=torch.int64).view(len(tables), width)
        slots = (table[host.row_request, host.positions // block_size] * block_size
                 + host.positions % block_size)                                 # [num_tokens]
        if device.type != "cpu":
            table, slots = (t.to(device, non_blocking=True) for t in (table, slots))
        metas.append(dataclasses.replace(first, slot_mapping=slots, block_table=table,
                                         windows={}))
    return metas


def build_kernel_metadata(query_lens: np.ndarray, context_lens: np.ndarray,
                          tables: Sequence[np.ndarray], block_size: int,
                          device: torch.device) -> list[AttentionMetadata]:
    """The kernel path's metadata of every KV group (`tables[g]`: the step's requests' block
    tables in group g, [num_reqs, max_blocks] int64, 0-padded, as `BlockTables.gather` cuts
    them), from int64 arrays of each request's query and context lengths, in layout order
    (one-token queries first). The same tensors as `build_group_metadata(..., torch_path=
    False)` builds, from numpy: positions and row tensors shared by the groups."""
    num_reqs = len(query_lens)
    not_one = np.flatnonzero(query_lens != 1)
    num_decodes = int(not_one[0]) if len(not_one) else num_reqs
    if (query_lens[num_decodes:] == 1).any():
        raise ValueError("one-token queries must come before longer chunks")
    row_request = np.repeat(np.arange(num_reqs), query_lens)                  # [num_tokens]
    first_row = np.cumsum(query_lens) - query_lens                             # [num_reqs]
    positions = (np.arange(len(row_request)) - first_row[row_request]
                 + context_lens[row_request])                                  # [num_tokens]
    block_index = positions // block_size
    offset = positions % block_size
    t_positions = torch.from_numpy(positions)
    t_rows = torch.from_numpy(row_request)
    t_kv_lens = torch.from_numpy(positions + 1)
    empty = torch.empty(0, dtype=torch.int64)
    metas = []
    for table in tables:
        slots = table[row_request, block_index] * block_size + offset         # [num_tokens]
        meta = AttentionMetadata(block_size, t_positions, torch.from_numpy(slots), num_decodes,
                                 empty, torch.empty(0, 1, 0),
                                 torch.empty(0, 1, 1, 0, dtype=torch.bool),
                                 torch.from_numpy(table), t_rows, t_kv_lens, [])
        metas.append(metadata_to(meta, device))
    return metas


def build_attention_metadata(query_lens: list[int], context_lens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             num_blocks: int, torch_path: bool = True) -> AttentionMetadata:
    """Per-step tensors for requests laid out in the given order (one-token queries first).

    `context_lens[i]` tokens of request i are already cached; its `query_lens[i]` new tokens
    take positions context_len .. context_len + query_len - 1; `block_tables[i]` must cover them.
    `num_blocks` is the cache's block count. `torch_path=False` (the layers use the C kernel)
    skips the torch path's gather rows, masks and prefill groups: they stay empty.
    """
    num_reqs = len(query_lens)
    num_decodes = 0
    while num_decodes < num_reqs and query_lens[num_decodes] == 1:
        num_decodes += 1
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError("one-token queries must come before longer chunks")
    kv_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_needed = [-(-n // block_size) for n in kv_lens]
    for table, need in zip(block_tables, blocks_needed, strict=True):
        if len(table) < need:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {need} blocks")

    # Positions and slots for every token at once: token t of request r sits at
    # position context_lens[r] + (t - first_row[r]) and block table row r.
    max_blocks = max(blocks_needed, default=1)
    table = torch.tensor([t[:need] + [0] * (max_blocks - need)
                          for t, need in zip(block_tables, blocks_needed)], dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    row_request = torch.repeat_interleave(torch.arange(num_reqs), q_lens)       # [num_tokens]
    first_row = torch.cumsum(q_lens, 0) - q_lens                                 # [num_reqs]
    positions = (torch.arange(len(row_request)) - first_row[row_request]
                 + torch.tensor(context_lens, dtype=torch.int64)[row_request])   # [num_tokens]
    slot_mapping = (table[row_request, positions // block_size] * block_size
                    + positions % block_size)                                    # [num_tokens]

    if not torch_path:
        empty = torch.empty(0, dtype=torch.int64)
        return AttentionMetadata(block_size, positions, slot_mapping, num_decodes, empty,
                                 torch.empty(0, 1, 0), torch.empty(0, 1, 1, 0, dtype=torch.bool),
                                 table, row_request, positions + 1, [])

    max_decode_blocks = max(blocks_needed[:num_decodes], default=1)
    decode_gather_rows = _gather_rows(table[:num_decodes, :max_decode_blocks], num_blocks)
    decode_kv_lens = torch.tensor(kv_lens[:num_decodes], dtype=torch.int64)
    decode_kv_len = max_decode_blocks * block_size
    decode_mask = (torch.arange(decode_kv_len)[None, :] < decode_kv_lens[:, None])[:, None]
    decode_bias = torch.zeros(num_decodes, 1, decode_kv_len).masked_fill_(~decode_mask,
                                                                          float("-inf"))

    prefill_groups = []
    row = num_decodes
    for first, end in _group_chunks(query_lens[num_decodes:], kv_lens[num_decodes:]):
        first, end = first + num_decodes, end + num_decodes
        q_lens_g, ctx_g = query_lens[first:end], context_lens[first:end]
        group = _prefill_group(row, q_lens_g, ctx_g, table[first:end], block_size, num_blocks)
        prefill_groups.append(group)
        row = group.token_end
    return AttentionMetadata(block_size, positions, slot_mapping, num_decodes,
                             decode_gather_rows, decode_bias, decode_mask[:, None],
                             table, row_request, positions + 1, prefill_groups, num_blocks,
                             list(query_lens), list(context_lens))


def _gather_rows(table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[requests, blocks] block ids -> key rows then value rows, as one flat int64 tensor.

    (One index_select over dim 0 of a 2-D view: over dim 1 of [2, num_blocks, ...], torch's
    CPU index_select is 2-3x slower, measured.)"""
    flat = table.reshape(-1)
    return torch.cat([flat, flat + num_blocks])


def _group_chunks(query_lens: list[int], kv_lens: list[int]) -> list[tuple[int, int]]:
    """Split consecutive chunks into [first, end) groups whose padding at most doubles the
    queries and the keys (one SDPA call per group beats one per chunk, but not at any cost)."""
    groups: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(query_lens) + 1):
        if i < len(query_lens):
            n = i + 1 - first
            q, kv = query_lens[first:i + 1], kv_lens[first:i + 1]
            if n * max(q) <= 2 * sum(q) and n * max(kv) <= 2 * sum(kv):
                continue
        groups.append((first, i))
        first = i
    return groups


def _prefill_group(row: int, query_lens: list[int], context_lens: list[int],
                   table: torch.Tensor, block_size: int, num_blocks: int) -> PrefillGroup:
    num_chunks = len(query_lens)
    max_q = max(query_lens)
    max_kv = max(c + q for c, q in zip(context_lens, query_lens))
    max_blocks = -(-max_kv // block_size)
    padded_rows = None
    if any(q != max_q for q in query_lens):
        padded_rows = torch.cat([torch.arange(q) + i * max_q for i, q in enumerate(query_lens)])
    mask = None
    if padded_rows is not None or any(context_lens):
        q_lens = torch.tensor(query_lens)[:, None, None]
        contexts = torch.tensor(context_lens)[:, None, None]
        i = torch.arange(max_q)[None, :, None]
        j = torch.arange(max_kv)[None, None, :]
        mask = ((j <= contexts + i) & (i < q_lens)) | ((i >= q_lens) & (j == 0))
        mask = mask[:, None]                  # [num_chunks, 1, max_query_len, max_kv_len]
    return PrefillGroup(row, row + sum(query_lens), num_chunks, max_q, max_kv, padded_rows,
                        _gather_rows(table[:, :max_blocks], num_blocks), mask)


def _windowed_torch_path(meta: AttentionMetadata, window: int) -> WindowedTorchPath:
    """The torch path's gather rows and masks for `window`: request r's keys are gathered
    from block first_block[r] (its first row's window start // block_size) on, padded with its
    last block, and key j of the gather is position first_block[r] * block_size + j."""
    if not meta.query_lens and meta.positions.numel():
        raise ValueError("the torch path needs metadata built with torch_path=True")
    block_size, num_decodes = meta.block_size, meta.num_decodes
    table = meta.block_table.cpu()
    kv_lens = [c + q for c, q in zip(meta.context_lens, meta.query_lens)]
    first_blocks = [max(0, c + 1 - window) // block_size for c in meta.context_lens]
    end_blocks = [-(-n // block_size) for n in kv_lens]

    def gather_rows(first: int, end: int) -> torch.Tensor:
        """Requests [first, end)'s blocks from their window start, as padded gather rows."""
        num = max([end_blocks[r] - first_blocks[r] for r in range(first, end)], default=1)
        rows = [table[r, first_blocks[r]:end_blocks[r]].tolist() for r in range(first, end)]
        padded = [ids + ids[-1:] * (num - len(ids)) for ids in rows]
        return _gather_rows(torch.tensor(padded, dtype=torch.int64).view(-1, num),
                            meta.num_blocks)

    offsets = torch.tensor([f * block_size for f in first_blocks], dtype=torch.int64)
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    decode_rows = gather_rows(0, num_decodes)
    decode_kv_len = decode_rows.numel() // 2 // max(num_decodes, 1) * block_size
    # [num_decodes, decode_kv_len]: the position of each gathered key
    key_pos = torch.arange(decode_kv_len)[None, :] + offsets[:num_decodes, None]
    decode_lens = lens[:num_decodes, None]
    decode_mask = ((key_pos < decode_lens) & (key_pos >= decode_lens - window))[:, None]
    decode_bias = torch.zeros(num_decodes, 1, decode_kv_len).masked_fill_(~decode_mask,
                                                                          float("-inf"))
    groups, request = [], num_decodes
    for group in meta.prefill_groups:
        first, end = request, request + group.num_chunks
        q_lens = torch.tensor(meta.query_lens[first:end])[:, None, None]
        contexts = torch.tensor(meta.context_lens[first:end])[:, None, None]
        max_kv = max(kv_lens[r] - first_blocks[r] * block_size for r in range(first, end))
        i = torch.arange(group.max_query_len)[None, :, None]
        pos = torch.arange(max_kv)[None, None, :] + offsets[first:end, None, None]
        j = torch.arange(max_kv)[None, None, :]
        mask = (((pos <= contexts + i) & (pos > contexts + i - window) & (i < q_lens))
                | ((i >= q_lens) & (j == 0)))      # padding rows see key 0 only (not empty)
        groups.append(PrefillGroup(group.token_start, group.token_end, group.num_chunks,
                                   group.max_query_len, max_kv, group.padded_rows,
                                   gather_rows(first, end), mask[:, None]))
        request = end
    device = meta.positions.device
    return WindowedTorchPath(decode_rows.to(device), decode_bias.to(device),
                             decode_mask[:, None].to(device),
                             [_group_to(g, device) for g in groups])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, kernel: PagedAttentionKernel | None = None,
                    window: int = 0, scales: KvScales | None = None) -> torch.Tensor:
    """Write the step's K/V into the cache, then attend over the cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns
    [num_tokens, num_heads * head_dim]. `kernel` (worker_svc.kernels), if given, attends
    every row straight from the blocks in one call instead of the torch path below.
    `window` > 0: each row attends only its last `window` keys (module docstring).
    A float8 cache (worker_svc.kernels.kv_quant) is written and read with `scales` (per tensor: the
    kernels hold their own, the same).
    """
    if window < 0:
        raise ValueError(f"paged_attention: window must be >= 0, got {window}")
    if kernel is not None:
        if window:
            return kernel(q, k, v, kv_cache, meta.slot_mapping, meta.block_table,
                          meta.row_request, meta.row_kv_lens, window)
        return kernel(q, k, v, kv_cache, meta.slot_mapping, meta.block_table, meta.row_request,
                      meta.row_kv_lens)
    num_blocks, num_kv_heads = kv_cache.shape[1], kv_cache.shape[3]
    write_slots(kv_cache, meta.slot_mapping, k, v, scales)
    blocks = kv_cache.view(2 * num_blocks, -1)        # [2*num_blocks, block_size*kv_heads*dim]

    path: AttentionMetadata | WindowedTorchPath = meta
    if window:
        if window not in meta.windows:
            meta.windows[window] = _windowed_torch_path(meta, window)
        path = meta.windows[window]
    outputs = []
    if meta.num_decodes:
        outputs.append(attend_decodes(q[:meta.num_decodes], blocks, path.decode_gather_rows,
                                      path.decode_bias, path.decode_mask, num_kv_heads, scales))
    for group in path.prefill_groups:
        outputs.append(attend_prefill_group(q[group.token_start:group.token_end], blocks, group,
                                            num_kv_heads, scales))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
