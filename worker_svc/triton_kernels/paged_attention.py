"""Attention for every row of a step, read from the paged KV cache where it lies (Triton).

The contract is that of the C kernel (worker_svc.kernels.paged_attention): every row is ONE
query token that attends the first `kv_lens[row]` keys and values of its request
`row_request[row]`, found through that request's row of `block_table` (position p lives in
block `block_table[r, p // block_size]` at offset `p % block_size`; cache layout in
worker_svc.attention). A decode row and a token of a prefill chunk are then the same thing:
a chunk token at position p has kv_len p + 1, so causal masking is only each row's length,
and one launch serves a mixed step without padding, gathering or masks.

Grid: one program per (row, KV head). The program loads the query heads that share its KV
head (GQA group, padded to a power of two with masked heads) and walks the row's keys in tiles
of `TILE` positions: every key and value is loaded once per group, never once per query head.
Scores and the softmax run in float32 with an online (running max and sum) softmax, so any
length fits in registers; scores are kept in log2 units (the scale folds in log2(e)) to use
exp2. Products are broadcast-multiply-and-sum, not `tl.dot`: a group has 1 to 8 heads, below
the 16 rows a tensor-core dot needs, and a decode row is bound by reading K/V anyway.

Small steps split each row's keys across programs (flash-decoding). With one program per (row,
KV head), a decode step of 64 rows of SmolLM2 (3 KV heads) is 192 programs walking their keys
tile after tile: the first H200 run measured 31 us per layer for one row and 42 us for 64
rows, most of the step. So a launch of at most `_SPLIT_MAX_ROWS` rows runs `_SPLITS` programs
per (row, KV head), each over its own run of whole tiles of the row's keys, writing its
running max, sum and unnormalised output (float32) to a scratch buffer; a second kernel
combines them per (row, KV head). A row's split depends only on its own length, never on the
other rows, so a decode graph (padded rows) and the same step run eagerly agree. Larger
launches (prefill chunks, big batches) fill the GPU with rows alone and keep the single pass.
Under TRITON_INTERPRET=1 (the CPU tests) programs run one after another in Python, so 16x the
programs made the model-level tests 3x slower: there the default is the single pass, and the
tests of the split ask for it (`splits=`).

Sliding window (`window` > 0): a row of kv_len keys attends [max(0, kv_len - window), kv_len);
its key loop starts at the tile that holds that start, so no block wholly before it is read
(kvcache_svc may free those and leave the null block, garbage, in the table). window 0: all.

An 8-bit cache (worker_svc.kernels.kv_quant) comes in as its bytes and each key and value is
decoded with bit operations (kv_write.fp8_to_half; why not Triton's casts: kv_write) to its
stored value, exactly, in float16 (tl.dot: in q's dtype, exact too); the per-tensor scales
cost no per-element multiply: the key scale folds into the query's scale and the value scale
into the output's normalisation.

A row with kv_len 0 (a padding row) outputs zeros. `paged_attention_reference` is the
vectorised torch twin, the tests' oracle.
"""

import math
import os

import torch
import triton
import triton.language as tl

from worker_svc.kernels.kv_quant import KvScales, dequantize, is_fp8
from worker_svc.triton_kernels.checks import (
    check_contiguous,
    check_device,
    check_float,
    check_index,
    check_kv_cache_dtype,
    check_row_view,
    interpreting,
    next_power_of_2,
)
from worker_svc.triton_kernels.kv_write import fp8_read_factor, fp8_to_half, kv_format, write_kv

# Head sizes the kernel takes: powers of two (tl.arange lengths must be one).
_HEAD_DIMS = tuple(2 ** i for i in range(4, 9))          # 16 .. 256
# Elements of the [group, TILE, head_dim] products a program holds: bounds registers.
_TILE_ELEMENTS = 8192
_MIN_TILE, _MAX_TILE = 4, 64
# Launches of at most this many rows split each row's keys over `_SPLITS` programs. At 128
# rows the scratch is rows x KV heads x splits x padded group x head_dim float32: 16 MiB for
# 8 KV heads of 4 x 128; the smallest capture sizes and every single-stream step are below.
_SPLIT_MAX_ROWS = 128
_SPLITS = 16
# Experimental, off by default until measured on a GPU: the split kernel's two products as
# `tl.dot` (tensor cores; the query heads padded to 16 rows, probabilities rounded to the cache's
# dtype for the second product, float32 in IEEE precision). The first H200 profile found ~5 us
# per tile in the broadcast products; this is the variant to measure against them
# (SPLITSERVE_TRITON_DOT_ATTENTION=1, or `dot=True`; `scripts/gpu-check --phase 3`).
_DOT = os.environ.get("SPLITSERVE_TRITON_DOT_ATTENTION", "") == "1"
_DOT_MIN_ROWS = 16      # tl.dot's smallest M, N and K


@triton.jit
def _load_kv(ptrs, mask, KV_MANT: tl.constexpr):
    """A tile of keys or values as stored, or 8-bit bytes as float16 (kv_write.fp8_to_half)."""
    if KV_MANT > 0:
        x = fp8_to_half(tl.load(ptrs, mask=mask, other=0), KV_MANT)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


# `max_blocks` (the block table's width) follows the longest request of each eager step: left
# to Triton's default, an int argument is specialized (1 becomes a constant, a multiple of 16
# gets a divisibility hint), so widths 1, 16 and others would each compile a variant mid-
# serving. It is only a row stride into the table, so no hint is lost. Strides that are fixed
# per model (q_row_stride) keep theirs. `window` likewise: a value of 1 or a multiple of 16
# would compile its own variant, and it only offsets the loop's start.
@triton.jit(do_not_specialize=["max_blocks", "window"])
def _paged_attention_kernel(q_ptr, q_row_stride, key_cache_ptr, value_cache_ptr,
                            block_table_ptr, max_blocks, row_request_ptr, kv_lens_ptr, window,
                            out_ptr, qk_scale, NUM_KV_HEADS: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                            GROUP_PAD: tl.constexpr, TILE: tl.constexpr,
                            KV_MANT: tl.constexpr = 0, v_scale=1.0):
    # (The 8-bit cache's arguments last, with defaults meaning a cache in q's dtype: the
    # argument list before them is the one test_triton_specialization.py binds.)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    group_ids = tl.arange(0, GROUP_PAD)
    head_ok = group_ids < GROUP                              # padding heads compute, never store
    heads = kv_head * GROUP + group_ids                      # [GROUP_PAD] query heads
    dims = tl.arange(0, HEAD_DIM)
    head_offsets = heads[:, None] * HEAD_DIM + dims[None, :]  # [GROUP_PAD, HEAD_DIM] in a row
    q = tl.load(q_ptr + row * q_row_stride + head_offsets, mask=head_ok[:, None], other=0.0)
    q = q.to(tl.float32) * qk_scale                          # [GROUP_PAD, HEAD_DIM], log2 units

    request = tl.load(row_request_ptr + row)                 # int64
    kv_len = tl.load(kv_lens_ptr + row).to(tl.int32)
    table = block_table_ptr + request * max_blocks
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)   # the window's first key
    for start in range((first // TILE) * TILE, kv_len, TILE):
        positions = start + tl.arange(0, TILE)
        # Every tile has a visible position: first < start + TILE and start < kv_len.
        visible = (positions < kv_len) & (positions >= first)
        block = tl.load(table + positions // BLOCK_SIZE, mask=visible, other=0)   # int64
        slot = block * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_offsets = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        k = _load_kv(key_cache_ptr + kv_offsets, visible[:, None], KV_MANT)
        v = _load_kv(value_cache_ptr + kv_offsets, visible[:, None], KV_MANT)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [GROUP_PAD, TILE]
        scores = tl.where(visible[None, :], scores, float("-inf"))
        # new_max is finite (every tile has a visible position): no -inf - -inf below.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)             # 0 on the first tile
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * v.to(tl.float32)[None, :, :],
                                              axis=1)
        running_max = new_max
    # kv_len 0: acc is 0 and so is the sum; divide by 1 to output zeros.
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None] * v_scale
    out_row = out_ptr + row * (NUM_KV_HEADS * GROUP * HEAD_DIM)
    tl.store(out_row + head_offsets, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit(do_not_specialize=["max_blocks", "window"])
def _paged_attention_split_kernel(q_ptr, q_row_stride, key_cache_ptr, value_cache_ptr,
                                  block_table_ptr, max_blocks, row_request_ptr, kv_lens_ptr,
                                  window, part_max_ptr, part_sum_ptr, part_acc_ptr, qk_scale,
                                  v_scale, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                                  GROUP_PAD: tl.constexpr, TILE: tl.constexpr,
                                  SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr, KV_MANT: tl.constexpr):
    """`_paged_attention_kernel`'s loop over one split's tiles (program_id 2) of a row's
    keys; writes that split's running max, sum and unnormalised output (float32, times
    v_scale). USE_DOT: the products on `tl.dot` (GROUP_PAD >= 16, TILE >= 16), K and V in
    q's dtype."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group_ids = tl.arange(0, GROUP_PAD)
    head_ok = group_ids < GROUP
    heads = kv_head * GROUP + group_ids
    dims = tl.arange(0, HEAD_DIM)
    head_offsets = heads[:, None] * HEAD_DIM + dims[None, :]
    q_in = tl.load(q_ptr + row * q_row_stride + head_offsets, mask=head_ok[:, None], other=0.0)
    q = q_in.to(tl.float32) * qk_scale

    request = tl.load(row_request_ptr + row)
    kv_len = tl.load(kv_lens_ptr + row).to(tl.int32)
    table = block_table_ptr + request * max_blocks
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    # The row's tiles [lo, kv_len) in runs of `per_split` tiles, one run per split; the
    # splits past the last run have no tiles and write (-inf, 0, 0).
    lo = (first // TILE) * TILE
    per_split = tl.cdiv(tl.cdiv(kv_len - lo, TILE), SPLITS)
    begin = lo + split * per_split * TILE
    end = tl.minimum(begin + per_split * TILE, kv_len)
    for start in range(begin, end, TILE):
        positions = start + tl.arange(0, TILE)
        visible = (positions < kv_len) & (positions >= first)
        block = tl.load(table + positions // BLOCK_SIZE, mask=visible, other=0)
        slot = block * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_offsets = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        k = _load_kv(key_cache_ptr + kv_offsets, visible[:, None], KV_MANT)
        v = _load_kv(value_cache_ptr + kv_offsets, visible[:, None], KV_MANT)
        if USE_DOT:
            scores = tl.dot(q_in, tl.trans(k.to(q_in.dtype)),
                            input_precision=DOT_PRECISION) * qk_scale
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        if USE_DOT:
            acc = acc * rescale[:, None] + tl.dot(probs.to(q_in.dtype), v.to(q_in.dtype),
                                                  input_precision=DOT_PRECISION)
        else:
            acc = acc * rescale[:, None] + tl.sum(
                probs[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        running_max = new_max
    part = ((row * NUM_KV_HEADS + kv_head) * SPLITS + split) * GROUP_PAD + group_ids
    tl.store(part_max_ptr + part, running_max)
    tl.store(part_sum_ptr + part, running_sum)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc * v_scale)


@triton.jit
def _combine_splits_kernel(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SPLITS: tl.constexpr):
    """One (row, KV head): the splits' partial softmaxes rescaled to their common max."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    group_ids = tl.arange(0, GROUP_PAD)
    head_ok = group_ids < GROUP
    dims = tl.arange(0, HEAD_DIM)
    base = (row * NUM_KV_HEADS + kv_head) * SPLITS
    every = (base + tl.arange(0, SPLITS))[:, None] * GROUP_PAD + group_ids[None, :]
    top = tl.max(tl.load(part_max_ptr + every), axis=0)           # [GROUP_PAD]
    top = tl.where(top == float("-inf"), 0.0, top)               # kv_len 0: no split has keys
    total = tl.zeros([GROUP_PAD], tl.float32)
    out = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for split in tl.static_range(SPLITS):
        part = (base + split) * GROUP_PAD + group_ids
        weight = tl.exp2(tl.load(part_max_ptr + part) - top)     # 0 for a split without keys
        total += weight * tl.load(part_sum_ptr + part)
        out += weight[:, None] * tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :])
    out = out / tl.where(total > 0, total, 1.0)[:, None]
    heads = kv_head * GROUP + group_ids
    out_row = out_ptr + row * (NUM_KV_HEADS * GROUP * HEAD_DIM)
    tl.store(out_row + heads[:, None] * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def default_splits(rows: int) -> int:
    """Programs per (row, KV head) for a launch of `rows` rows (see the module's doc)."""
    return _SPLITS if rows <= _SPLIT_MAX_ROWS and not interpreting() else 1


def _check(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           row_request: torch.Tensor, kv_lens: torch.Tensor, window: int) -> None:
    name = "paged_attention"
    if window < 0:
        raise ValueError(f"{name}: window must be >= 0, got {window}")
    check_float(name, "q", q)
    check_kv_cache_dtype(name, kv_cache, q.dtype)
    check_contiguous(name, "kv_cache", kv_cache)
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [rows, num_heads, head_dim], got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != q.shape[2]:
        raise ValueError(f"{name}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                         f"{q.shape[2]}], got {tuple(kv_cache.shape)}")
    rows, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    check_row_view(name, "q", q, (rows, num_heads, head_dim))
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"{name}: head_dim must be a power of two in 16..256, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if (block_table.dtype != torch.int64 or block_table.dim() != 2
            or block_table.shape[1] == 0 or not block_table.is_contiguous()):
        raise ValueError(f"{name}: block_table must be contiguous int64 [num_requests, "
                         f"max_blocks >= 1], got {block_table.dtype} {tuple(block_table.shape)}")
    check_index(name, "row_request", row_request, rows)
    check_index(name, "kv_lens", kv_lens, rows)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    row_request: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                    window: int = 0, *, scales: KvScales | None = None,
                    tile_tokens: int | None = None, splits: int | None = None,
                    dot: bool | None = None) -> torch.Tensor:
    """Attend every row of q [rows, num_heads, head_dim] (one query token per row; any row
    stride, heads and dim contiguous) over the first kv_lens[row] positions of request
    row_request[row] in kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], through
    block_table [num_requests, max_blocks] (int64, contiguous); `window` > 0: only the last
    `window` of those positions. Returns [rows, num_heads * head_dim] in q's dtype. A float8
    cache is read as stored * `scales` (kv_quant.dequantize; None: 1.0).
    `tile_tokens` (a power of two) overrides the positions per tile, `splits` (a power of
    two; 1: the single pass) the programs per (row, KV head), both for tests; `dot` the split
    kernel's `tl.dot` variant (None: SPLITSERVE_TRITON_DOT_ATTENTION). Table entries
    and lengths are not range-checked (that would cost a sync)."""
    _check(q, kv_cache, block_table, row_request, kv_lens, window)
    check_device("paged_attention", q, kv_cache, block_table, row_request, kv_lens)
    rows, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(rows, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if tile_tokens is None:
        tile = max(_MIN_TILE, min(_MAX_TILE, _TILE_ELEMENTS // (group_pad * head_dim)))
    elif tile_tokens < 1 or tile_tokens != next_power_of_2(tile_tokens):
        raise ValueError(f"paged_attention: tile_tokens must be a power of two, got "
                         f"{tile_tokens}")
    else:
        tile = tile_tokens
    if splits is None:
        splits = default_splits(rows)
    elif splits < 1 or splits != next_power_of_2(splits):
        raise ValueError(f"paged_attention: splits must be a power of two, got {splits}")
    qk_scale, v_scale = scale * math.log2(math.e), 1.0
    cache, kv_mant, _ = kv_format(kv_cache)
    if kv_mant:
        scales, factor = scales or KvScales(), fp8_read_factor(kv_cache)
        qk_scale, v_scale = qk_scale * scales.k_scale * factor, scales.v_scale * factor
    if splits == 1:
        _paged_attention_kernel[(rows, num_kv_heads)](
            q, q.stride(0), cache[0], cache[1], block_table, block_table.shape[1],
            row_request, kv_lens, window, out, qk_scale, NUM_KV_HEADS=num_kv_heads,
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad,
            TILE=tile, KV_MANT=kv_mant, v_scale=v_scale)
        return out
    use_dot = _DOT if dot is None else dot
    if use_dot:      # tl.dot's smallest shapes: 16 query rows (padding heads), 16 keys a tile
        group_pad = max(group_pad, _DOT_MIN_ROWS)
        tile = max(tile, _DOT_MIN_ROWS) if tile_tokens is None else tile
        if tile < _DOT_MIN_ROWS:
            raise ValueError(f"paged_attention: dot=True needs tile_tokens >= {_DOT_MIN_ROWS}")
    part_max = torch.empty(rows, num_kv_heads, splits, group_pad, dtype=torch.float32,
                           device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(rows, num_kv_heads, splits, group_pad, head_dim,
                           dtype=torch.float32, device=q.device)
    _paged_attention_split_kernel[(rows, num_kv_heads, splits)](
        q, q.stride(0), cache[0], cache[1], block_table, block_table.shape[1],
        row_request, kv_lens, window, part_max, part_sum, part_acc, qk_scale, v_scale,
        NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group,
        GROUP_PAD=group_pad, TILE=tile, SPLITS=splits, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_MANT=kv_mant)
    _combine_splits_kernel[(rows, num_kv_heads)](
        part_max, part_sum, part_acc, out, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        GROUP=group, GROUP_PAD=group_pad, SPLITS=splits)
    return out


def paged_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor,
                              block_table: torch.Tensor, row_request: torch.Tensor,
                              kv_lens: torch.Tensor, scale: float, window: int = 0, *,
                              scales: KvScales | None = None, tile_tokens: int | None = None,
                              splits: int | None = None, dot: bool | None = None
                              ) -> torch.Tensor:
    """Torch twin of `paged_attention` (the tests' oracle): gathers every row's keys and
    values into a padded [rows, max_kv_len, ...] copy, masks outside each row's keys (slots
    there read as zeros), softmax in float32. `tile_tokens`, `splits` and `dot` are accepted
    and ignored (they only change the summation order and rounding)."""
    _check(q, kv_cache, block_table, row_request, kv_lens, window)
    rows, num_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    max_len = int(kv_lens.max()) if rows else 0
    positions = torch.arange(max_len, device=q.device)                        # [max_len]
    visible = positions[None, :] < kv_lens[:, None]                           # [rows, max_len]
    if window > 0:
        visible &= positions[None, :] >= kv_lens[:, None] - window
    columns = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[row_request][:, columns]                             # [rows, max_len]
    slots = torch.where(visible, blocks * block_size + positions % block_size, 0)
    cache = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    hidden = ~visible[:, :, None, None]             # slot 0 stands in for them: never read it
    scales, raw = scales or KvScales(), cache.view(torch.uint8) if is_fp8(cache.dtype) else None
    keys, values = [                                # [rows, max_len, kv_heads, dim] each
        cache[i][slots].float() if raw is None     # (CPU torch cannot index float8: bytes)
        else dequantize(raw[i][slots].view(cache.dtype), scale, torch.float32)
        for i, scale in enumerate((scales.k_scale, scales.v_scale))]
    keys, values = keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0)
    queries = q.float().reshape(rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("rhgd,rnhd->rhgn", queries, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)     # kv_len 0: all -inf -> NaN -> 0
    out = torch.einsum("rhgn,rnhd->rhgd", probs, values)      # [rows, kv_heads, group, dim]
    return out.reshape(rows, num_heads * head_dim).to(q.dtype)


def paged_attention_with_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                               block_table: torch.Tensor, row_request: torch.Tensor,
                               kv_lens: torch.Tensor, scale: float, window: int = 0,
                               scales: KvScales | None = None) -> torch.Tensor:
    """`write_kv(k, v, kv_cache, slot_mapping, scales)`, then `paged_attention`: a layer's
    whole attention step, in the C kernel's argument order (PagedAttentionKernel.__call__)."""
    write_kv(k, v, kv_cache, slot_mapping, scales)
    return paged_attention(q, kv_cache, block_table, row_request, kv_lens, scale, window,
                           scales=scales)
