"""`paged_attention_amx.c` (bfloat16 on AMX tiles) against a float32 reference and its twin
`paged_attention.c`: decodes and prefill chunks, several shapes, thread-count independence.
The run tests need a CPU at level amx; the compile test runs everywhere."""

import shutil

import pytest
import torch

from worker_svc.attention import build_attention_metadata, paged_attention
from worker_svc.kernels import build
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.paged_attention import AmxPagedAttentionKernel, paged_attention_kernel

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler")
needs_amx = pytest.mark.skipif(not HAS_CC or detect_level() < CpuLevel.AMX,
                               reason="needs a C compiler and CPU level amx")

# bfloat16 output (half an ulp: up to 2^-8 relative) plus P rounded to bfloat16.
ATOL, RTOL = 1.5e-2, 1e-2


@needs_cc
@pytest.mark.parametrize("head_dim,group", [(64, 3), (128, 8)])
def test_compiles_at_level_amx_anywhere(tmp_path, head_dim: int, group: int) -> None:
    build.compile_only("paged_attention_amx.c", CpuLevel.AMX,
                       {"HEAD_DIM": head_dim, "GROUP": group, "ELEM_BF16": 1},
                       tmp_path / "amx.so")


def _float32_reference(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                       row_request: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    """Every row over its request's first kv_lens[row] keys, in float32 (cache already
    holds the step's K/V)."""
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    num_heads = q.shape[1]
    out = torch.empty(q.shape[0], num_heads, head_dim)
    for request, table in enumerate(tables):
        rows = (row_request == request).nonzero().flatten()
        if not len(rows):
            continue
        longest = int(kv_lens[rows].max())
        ids = torch.tensor(table)
        keys, values = (cache[i, ids].float().reshape(-1, num_kv_heads, head_dim)[:longest]
                        .repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
                        for i in (0, 1))                        # [heads, longest, dim]
        scores = q[rows].float().transpose(0, 1) @ keys.transpose(1, 2) * head_dim ** -0.5
        hidden = torch.arange(longest)[None, :] >= kv_lens[rows][:, None]   # [rows, keys]
        probs = torch.softmax(scores.masked_fill(hidden[None], float("-inf")), dim=-1)
        out[rows] = (probs @ values).transpose(0, 1)
    return out.reshape(q.shape[0], -1)


def _step(query_lens: list[int], context_lens: list[int], block_size: int, num_kv_heads: int,
          group: int, head_dim: int, seed: int = 0, spread: float = 1.0):
    """Random inputs for one step: scattered block tables; every slot no row may read holds
    NaN (so a kernel that reads past a row's keys shows it)."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n])
        start += n
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for table, context in zip(tables, context_lens):
        slots = cache[:, table].view(2, -1, num_kv_heads, head_dim)
        slots[:, :context] = torch.randn(2, context, num_kv_heads, head_dim, generator=gen)
        cache[:, table] = slots.view(2, len(table), block_size, num_kv_heads, head_dim)
    rows = sum(query_lens)
    num_heads = num_kv_heads * group
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, generator=gen) * spread
    q, k, v = qkv.bfloat16().split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, num_blocks,
                                    torch_path=False)
    return q, k, v, cache.bfloat16(), tables, meta


def _amx(head_dim: int, group: int) -> AmxPagedAttentionKernel:
    kernel = paged_attention_kernel(CpuLevel.AMX, head_dim, group, torch.bfloat16)
    assert isinstance(kernel, AmxPagedAttentionKernel), "the AMX kernel did not build"
    return kernel


def _check(query_lens: list[int], context_lens: list[int], block_size: int, num_kv_heads: int,
           group: int, head_dim: int, spread: float = 1.0) -> None:
    q, k, v, cache, tables, meta = _step(query_lens, context_lens, block_size, num_kv_heads,
                                         group, head_dim, spread=spread)
    kernel = _amx(head_dim, group)
    amx_cache, twin_cache = cache.clone(), cache.clone()
    got = paged_attention(q, k, v, amx_cache, meta, kernel)
    twin = paged_attention(q, k, v, twin_cache, meta, kernel.twin())
    assert torch.equal(amx_cache.view(torch.int16), twin_cache.view(torch.int16))
    expected = _float32_reference(q, amx_cache, tables, meta.row_request, meta.row_kv_lens)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected, atol=ATOL, rtol=RTOL)
    # P in bfloat16 costs little next to the output's own rounding (which bounds the twin's
    # error): measured 1.15x the twin's largest difference, 1.4x its mean.
    error, twin_error = (got.float() - expected).abs(), (twin.float() - expected).abs()
    assert error.max() <= 1.5 * twin_error.max() and error.mean() <= 2 * twin_error.mean()
    torch.testing.assert_close(got.float(), twin.float(), atol=ATOL, rtol=RTOL)


@needs_amx
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 64, 16), (4, 64, 32), (8, 128, 16),
                                                       (3, 128, 32)])
def test_decodes_across_tile_and_block_edges(group: int, head_dim: int, block_size: int) -> None:
    # Keys per row: 1, 15, 16, 17, 176, 1000, 3000 (tiles of 16 and 32 keys, blocks of 16/32).
    contexts = [0, 14, 15, 16, 175, 999, 2999]
    _check([1] * len(contexts), contexts, block_size, 2, group, head_dim)


@needs_amx
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128), (8, 64)])
def test_prefill_chunks_beside_decodes(group: int, head_dim: int) -> None:
    # Decodes, a fresh prompt, chunks continuing after cached tokens (mid-block, aligned), a
    # 70-row chunk spanning several items, a one-row-past-a-tile chunk: causal per row.
    _check([1, 1, 1, 6, 3, 70, 17, 40], [5, 176, 0, 0, 9, 40, 16, 999], 16, 3, group, head_dim)


@needs_amx
def test_many_decodes_go_out_a_request_at_a_time() -> None:
    # 40 decode rows: enough that each thread takes a request's KV heads together (fewer
    # requests go out a head at a time; both are checked against the twin).
    _check([1] * 40, [(37 * i) % 400 for i in range(40)], 16, 3, 3, 64)


@needs_amx
def test_peaked_softmax_and_block_size_32() -> None:
    # Scores in the tens: most weight on a few keys, exp far from 1.
    _check([1, 1, 33, 20], [30, 500, 0, 100], 32, 3, 3, 64, spread=4.0)


@needs_amx
def test_same_result_for_any_thread_count_and_row_grouping() -> None:
    # 10 runs: 1 and 2 threads take a request's KV heads together, 3 threads a head at a time.
    q, k, v, cache, _, meta = _step([1] * 5 + [50, 37], [3, 100, 17, 300, 0, 60, 0], 16, 3, 3,
                                    64, seed=3)
    kernel = _amx(64, 3)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(paged_attention(q, k, v, cache.clone(), meta, kernel))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # A decode row attends the same alone as beside the others.
    alone = build_attention_metadata([1], [300], [meta.block_table[3].tolist()], 16,
                                     cache.shape[1], torch_path=False)
    one = paged_attention(q[3:4], k[3:4], v[3:4], cache.clone(), alone, kernel)
    assert torch.equal(one, outs[0][3:4])


@needs_amx
def test_other_block_sizes_and_shapes_use_the_twin() -> None:
    kernel = _amx(64, 3)
    assert kernel._pick(8, 16) is kernel.amx_fn and kernel._pick(8, 8) is kernel.fn
    _check([1, 1, 5], [3, 40, 12], 8, 3, 3, 64)   # block_size 8: paged_attention.c
    assert not isinstance(paged_attention_kernel(CpuLevel.AMX, 64, 3, torch.float32),
                          AmxPagedAttentionKernel)
    assert not isinstance(paged_attention_kernel(CpuLevel.AMX, 48, 3, torch.bfloat16),
                          AmxPagedAttentionKernel)
    assert not isinstance(paged_attention_kernel(CpuLevel.AVX512_BF16, 64, 3, torch.bfloat16),
                          AmxPagedAttentionKernel)
