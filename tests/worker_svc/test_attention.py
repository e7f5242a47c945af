"""Paged attention: the fast path against its slow twin on random data."""

import pytest
import torch

from worker_svc.attention import (
    _group_chunks,
    build_attention_metadata,
    build_group_metadata,
    paged_attention,
)
from worker_svc.kernels import paged_attention_torch
from worker_svc.kernels.paged_attention_torch import reference_paged_attention

NUM_BLOCKS = 48
BLOCK_SIZE = 4


def _run_both(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              num_heads: int, num_kv_heads: int, dtype: torch.dtype = torch.float32):
    head_dim = 16
    gen = torch.Generator().manual_seed(sum(query_lens) * 31 + sum(context_lens))
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Cached context: random K/V already sitting in every real block; block 0 stays zero.
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype)
    cache[:, 0] = 0
    fast_cache, slow_cache = cache.clone(), cache.clone()

    meta = build_attention_metadata(query_lens, context_lens, block_tables, BLOCK_SIZE, NUM_BLOCKS)
    fast = paged_attention(q, k, v, fast_cache, meta)
    slow = reference_paged_attention(q, k, v, slow_cache, query_lens, context_lens, block_tables)
    return fast, slow, fast_cache, slow_cache


@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (4, 4), (9, 3)])
def test_mixed_batch_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    query_lens = [1, 1, 1,      # decodes with short, block-aligned and long contexts
                  1,            # a one-token chunk of a prompt with cached context
                  7,            # a fresh prefill spanning two blocks
                  5,            # a chunk after 6 cached tokens (starts mid-block)
                  9]            # a chunk after 8 cached tokens (starts block-aligned)
    context_lens = [0, 8, 21, 3, 0, 6, 8]
    block_tables = [[1], [2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12],
                    [13, 14], [15, 16, 17], [18, 19, 20, 21, 22, 23]]
    fast, slow, fast_cache, slow_cache = _run_both(query_lens, context_lens, block_tables,
                                                   num_heads, num_kv_heads)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_cache, slow_cache)
    assert not fast_cache[:, 0].any(), "the null block was written"


def test_reads_blocks_written_in_the_same_step() -> None:
    # Request 1 is a prefix hit on the two blocks request 0 fills in this very step.
    query_lens = [8, 3]
    context_lens = [0, 8]
    block_tables = [[3, 4], [3, 4, 5]]
    fast, slow, fast_cache, slow_cache = _run_both(query_lens, context_lens, block_tables, 4, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_cache, slow_cache)


def test_only_decodes_and_only_prefills() -> None:
    fast, slow, *_ = _run_both([1, 1], [5, 12], [[1, 2], [3, 4, 5, 6]], 4, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    fast, slow, *_ = _run_both([3, 6], [0, 2], [[1], [2, 3]], 4, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_decodes", [1, 3, 4, 9])   # SDPA below 4 decodes, matmuls above
def test_decode_paths_match_reference(num_decodes: int) -> None:
    contexts = [(5 * i + 3) % 17 for i in range(num_decodes)]
    tables = [[1 + 5 * i + b for b in range(5)] for i in range(num_decodes)]
    fast, slow, *_ = _run_both([1] * num_decodes + [3], contexts + [2],
                               tables + [[46, 47]], 6, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gather_bytes", [1, 25600])   # sub-batches of 1, then of 5 and 4
def test_decode_sub_batches_match_reference(gather_bytes: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention_torch, "_MAX_DECODE_GATHER_BYTES", gather_bytes)
    contexts = [(7 * i + 2) % 19 for i in range(9)]
    tables = [[1 + 5 * i + b for b in range(5)] for i in range(9)]
    fast, slow, *_ = _run_both([1] * 9, contexts, tables, 6, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_decodes", [2, 6])
def test_bfloat16_close_to_reference(num_decodes: int) -> None:
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(num_decodes)]
    fast, slow, *_ = _run_both([1] * num_decodes + [6], [9 - i for i in range(num_decodes)] + [4],
                               tables + [[40, 41, 42]], 6, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)


def test_block_tables_may_hold_more_blocks_than_needed() -> None:
    # Blocks allocated ahead of need are ignored; the null block pads decode tables.
    fast, slow, *_ = _run_both([1, 1, 4], [2, 9, 1], [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]],
                               4, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_prefill_groups_limit_padding() -> None:
    assert _group_chunks([7, 5, 9], [7, 11, 17]) == [(0, 3)]
    assert _group_chunks([40, 3, 2, 30], [40, 3, 2, 30]) == [(0, 2), (2, 4)]
    meta = build_attention_metadata([5, 5], [0, 0], [[1, 2], [3, 4]], BLOCK_SIZE, NUM_BLOCKS)
    [group] = meta.prefill_groups
    assert group.mask is None and group.padded_rows is None   # plain causal, no padding


def test_unequal_and_equal_prefill_groups_match_reference() -> None:
    # Very unequal chunks split into several groups; equal fresh ones need no mask at all.
    fast, slow, *_ = _run_both([2, 11, 3, 2], [5, 0, 0, 9], [[1, 2, 3], [4, 5, 6], [7], [8, 9, 10]],
                               6, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    fast, slow, *_ = _run_both([1, 6, 6, 6], [3, 0, 0, 0], [[1], [2, 3], [4, 5], [6, 7]], 6, 2)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_metadata_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="one-token queries"):
        build_attention_metadata([3, 1], [0, 4], [[1], [2, 3]], BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([1], [8], [[1, 2]], BLOCK_SIZE, NUM_BLOCKS)


def test_slots_and_positions() -> None:
    meta = build_attention_metadata([1, 3], [5, 2], [[7, 9], [4, 6]], BLOCK_SIZE, NUM_BLOCKS)
    assert meta.positions.tolist() == [5, 2, 3, 4]
    # position 5 -> block 9 offset 1; positions 2, 3 -> block 4; position 4 -> block 6.
    assert meta.slot_mapping.tolist() == [9 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 6 * 4 + 0]
    assert meta.num_decodes == 1
    assert meta.decode_bias.shape == (1, 1, 2 * BLOCK_SIZE)
    assert (meta.decode_bias == 0).sum() == 6


@pytest.mark.parametrize("torch_path", [False, True])
def test_group_metadata_is_each_groups_own_metadata(torch_path: bool) -> None:
    """Per KV group, the metadata of its own tables (a sliding group's may start with the
    null block); on the kernel path the groups share positions and row tensors."""
    query_lens, context_lens = [1, 1, 6], [9, 4, 3]
    group_tables = [[[1, 2, 3], [4, 5], [6, 7, 8]],
                    [[0, 9, 10], [11, 12], [13, 14, 15]]]
    metas = build_group_metadata(query_lens, context_lens, group_tables, BLOCK_SIZE,
                                 NUM_BLOCKS, torch.device("cpu"), torch_path=torch_path)
    for meta, tables in zip(metas, group_tables, strict=True):
        alone = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE,
                                         NUM_BLOCKS, torch_path=torch_path)
        for name in ("positions", "slot_mapping", "block_table", "row_request", "row_kv_lens"):
            assert torch.equal(getattr(meta, name), getattr(alone, name)), name
    assert not torch.equal(metas[0].slot_mapping, metas[1].slot_mapping)
    if not torch_path:
        assert metas[1].positions is metas[0].positions
    with pytest.raises(ValueError, match="cannot hold"):
        build_group_metadata(query_lens, context_lens, [group_tables[0], [[1], [2], [3]]],
                             BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"), torch_path=torch_path)
