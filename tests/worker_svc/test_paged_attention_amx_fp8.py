"""`paged_attention_amx.c` over an 8-bit (float8 e4m3fn / e5m2) KV cache, bfloat16 compute:
the same cache bytes as its twin `paged_attention.c` (and so as `kv_quant.write_slots`,
test_paged_attention_fp8.py), outputs against a float32 reference over the same float8 values
and against the twin, with windows and block sizes the AMX kernel leaves to the twin. The run
tests need a CPU at level amx; the fp8 builds' compile check at level amx runs everywhere
(test_paged_attention_fp8.py)."""

import shutil

import pytest
import torch

from worker_svc.attention import build_attention_metadata, paged_attention
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.kv_quant import FP8_DTYPES, KvScales, dequantize
from worker_svc.kernels.paged_attention import AmxPagedAttentionKernel, paged_attention_kernel
from worker_svc.kernels.paged_attention_torch import reference_paged_attention

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
pytestmark = pytest.mark.skipif(not HAS_CC or detect_level() < CpuLevel.AMX,
                                reason="needs a C compiler and CPU level amx")
FORMATS = pytest.mark.parametrize("kv_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])

# As test_paged_attention_amx.py: bfloat16 output plus P rounded to bfloat16 (K and V widen
# to bfloat16 exactly, so the cache's format adds nothing here).
ATOL, RTOL = 1.5e-2, 1e-2
SCALES = KvScales(0.45, 1.7)


def _amx(head_dim: int, group: int, kv_dtype: torch.dtype) -> AmxPagedAttentionKernel:
    kernel = paged_attention_kernel(CpuLevel.AMX, head_dim, group, torch.bfloat16, kv_dtype,
                                    SCALES)
    assert isinstance(kernel, AmxPagedAttentionKernel), "the AMX kernel did not build"
    assert kernel.kv_dtype == kv_dtype and kernel.kv_scales == SCALES
    return kernel


def _check(query_lens: list[int], context_lens: list[int], block_size: int, num_kv_heads: int,
           group: int, head_dim: int, kv_dtype: torch.dtype, window: int = 0) -> None:
    """AMX and twin on one step over a cache of random float8 values whose slots no row may
    read hold NaN bytes (0x7f: read, they would add values of hundreds or more)."""
    gen = torch.Generator().manual_seed(block_size * 7 + group + head_dim)
    kv_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n])
        start += n
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 0x7f,
                       dtype=torch.uint8).view(kv_dtype)
    raw = cache.view(torch.uint8)
    for table, context in zip(tables, context_lens):
        first = max(0, context + 1 - window) if window else 0
        values = torch.randn(2, context, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
        slots = raw[:, table].view(2, -1, num_kv_heads, head_dim)
        slots[:, first:context] = values[:, first:].view(torch.uint8)
        raw[:, table] = slots.view(2, len(table), block_size, num_kv_heads, head_dim)
    rows = sum(query_lens)
    num_heads = num_kv_heads * group
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q, k, v = qkv.bfloat16().split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, num_blocks,
                                    torch_path=False)
    kernel = _amx(head_dim, group, kv_dtype)
    amx_cache, twin_cache, ref_cache = cache.clone(), cache.clone(), cache.clone()
    got = paged_attention(q, k, v, amx_cache, meta, kernel, window=window)
    twin = paged_attention(q, k, v, twin_cache, meta, kernel.twin(), window=window)
    # float32 throughout (q, k, v widen exactly; the reference writes the same bytes)
    expected = reference_paged_attention(q.float(), k.float(), v.float(), ref_cache, query_lens,
                                         context_lens, tables, window=window, scales=SCALES)
    assert torch.equal(amx_cache.view(torch.uint8), twin_cache.view(torch.uint8))
    assert torch.equal(amx_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), expected, atol=ATOL, rtol=RTOL)
    error, twin_error = (got.float() - expected).abs(), (twin.float() - expected).abs()
    assert error.max() <= 1.5 * twin_error.max() and error.mean() <= 2 * twin_error.mean()
    torch.testing.assert_close(got.float(), twin.float(), atol=ATOL, rtol=RTOL)


@FORMATS
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 64, 16), (4, 128, 32), (1, 64, 16),
                                                       (8, 128, 16)])
def test_decodes_across_tile_and_block_edges(kv_dtype: torch.dtype, group: int, head_dim: int,
                                             block_size: int) -> None:
    # Keys per row: 1, 15, 16, 17, 176, 1000 (runs of 16 keys, blocks of 16 and 32).
    contexts = [0, 14, 15, 16, 175, 999]
    _check([1] * len(contexts), contexts, block_size, 2, group, head_dim, kv_dtype)


@FORMATS
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128)])
def test_prefill_chunks_beside_decodes(kv_dtype: torch.dtype, group: int, head_dim: int) -> None:
    _check([1, 1, 1, 6, 3, 70, 17], [5, 176, 0, 0, 9, 40, 16], 16, 3, group, head_dim, kv_dtype)


@FORMATS
def test_sliding_window(kv_dtype: torch.dtype) -> None:
    # Window starts inside runs of 16 and blocks: the first run's V before it widens as zeros.
    _check([1, 1, 1, 30], [100, 7, 250, 40], 16, 3, 3, 64, kv_dtype, window=37)


@FORMATS
def test_block_sizes_not_a_multiple_of_16_use_the_twin(kv_dtype: torch.dtype) -> None:
    kernel = _amx(64, 3, kv_dtype)
    assert kernel._pick(8, 12) is kernel.fn and kernel._pick(8, 32) is kernel.amx_fn
    _check([1, 1, 5], [3, 40, 12], 12, 3, 3, 64, kv_dtype)


@FORMATS
@pytest.mark.parametrize("v_scale", [1.0, 0.37])
def test_reads_every_byte_exactly(kv_dtype: torch.dtype, v_scale: float) -> None:
    # As in test_paged_attention_fp8.py: rows of one key output that key's V row as
    # kv_quant.dequantize reads it (P = 1 is exact in bfloat16, the widening is exact).
    head_dim, rows = 64, 4
    scales = KvScales(1.0, v_scale)
    kernel = paged_attention_kernel(CpuLevel.AMX, head_dim, 1, torch.bfloat16, kv_dtype, scales)
    assert isinstance(kernel, AmxPagedAttentionKernel), "the AMX kernel did not build"
    every = torch.arange(256, dtype=torch.uint8)
    every[~every.view(kv_dtype).float().isfinite()] = 0
    cache = torch.zeros(2, rows + 1, 16, 1, head_dim, dtype=kv_dtype)
    cache.view(torch.uint8)[1, 1:, 0, 0] = every.view(rows, head_dim)
    q = torch.randn(rows, 1, head_dim).bfloat16()
    kv = torch.randn(rows, 1, head_dim).bfloat16()
    tables = (torch.arange(rows) + 1)[:, None]                 # key 0: slot 0 of block r + 1
    scratch = (torch.arange(rows) + 1) * 16 + 1                # the step's own K/V
    out = kernel(q, kv, kv, cache, scratch, tables, torch.arange(rows),
                 torch.ones(rows, dtype=torch.int64))
    expected = dequantize(every.view(kv_dtype), v_scale, torch.bfloat16).view(rows, head_dim)
    assert torch.equal(out, expected), (out.float() - expected.float()).abs().max()
