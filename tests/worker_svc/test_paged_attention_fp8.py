"""`paged_attention.c` with an 8-bit (float8 e4m3fn / e5m2) KV cache, at every level: the bytes
its KV write stores against `kv_quant.write_slots` (bit for bit, around every rounding edge of
both formats), its outputs against `reference_paged_attention(..., scales=)` (which reads the
same float8 values), and `worker_svc.attention.paged_attention` with the kernel against the
torch path. The AMX kernel's fp8 build: test_paged_attention_amx_fp8.py."""

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from worker_svc.attention import build_attention_metadata, paged_attention
from worker_svc.kernels import build
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.kv_quant import (
    FP8_DTYPES,
    FP8_MAX,
    KvScales,
    dequantize,
    write_slots,
)
from worker_svc.kernels.paged_attention import PagedAttentionKernel, paged_attention_kernel
from worker_svc.kernels.paged_attention_torch import reference_paged_attention

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernels fall back to torch")

FORMATS = pytest.mark.parametrize("kv_dtype", FP8_DTYPES, ids=["e4m3", "e5m2"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                                 ids=["float32", "bfloat16"])
# What tests/worker_svc/test_kernels.py allows per compute dtype.
CLOSE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
         torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _kernel(level: CpuLevel, head_dim: int, group: int, dtype: torch.dtype,
            kv_dtype: torch.dtype, scales: KvScales) -> PagedAttentionKernel:
    kernel = paged_attention_kernel(level, head_dim, group, dtype, kv_dtype, scales)
    assert kernel is not None, "the kernel did not build (see the log)"
    assert kernel.kv_dtype == kv_dtype and kernel.kv_scales == scales
    return kernel


def edge_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """float32 values at every rounding edge of the format: each finite value, each midpoint
    between neighbours (ties: to even) and the float32 numbers either side of both; halfway
    below the smallest subnormal; past the largest finite value (saturation, and the midpoint
    to where the next one would be); signed zeros, infinities, NaN, float32 subnormals."""
    everything = torch.arange(256, dtype=torch.uint8).view(kv_dtype).double()
    finite = everything[everything.isfinite()].unique()            # sorted, -max .. max
    mids = (finite[1:] + finite[:-1]) / 2
    limit = FP8_MAX[kv_dtype]
    top_step = limit - finite[-2].item()
    extra = torch.tensor([limit + top_step / 2, limit + top_step, 1e30, finite[finite > 0][0]
                          / 2, 1e-40, 1e-45, 0.0, -0.0, float("inf"), float("nan")],
                         dtype=torch.float64)
    extra = torch.cat([extra, -extra])
    base = torch.cat([finite, mids, extra]).float()
    up = torch.nextafter(base, torch.tensor(float("inf")))
    down = torch.nextafter(base, torch.tensor(float("-inf")))
    return torch.cat([base, up, down])


def _write(kernel: PagedAttentionKernel, k: torch.Tensor, v: torch.Tensor,
           cache: torch.Tensor) -> None:
    """Rows of k, v (one KV head) through the kernel's write: row r into block r + 1, slot 0
    (each row a request of one token, so that its attention reads only its own slot)."""
    rows = k.shape[0]
    block_size = cache.shape[2]
    slots = (torch.arange(rows) + 1) * block_size
    tables = (torch.arange(rows) + 1)[:, None]
    q = torch.zeros(rows, kernel.group, kernel.head_dim, dtype=k.dtype)
    kernel(q, k, v, cache, slots, tables, torch.arange(rows), torch.ones(rows, dtype=torch.int64))


@FORMATS
@DTYPES
@pytest.mark.parametrize("scales", [KvScales(), KvScales(0.5, 2.0), KvScales(0.37, 1.9)],
                         ids=["one", "powers_of_two", "other"])
def test_write_stores_the_bytes_of_kv_quant(kernel_level: CpuLevel, kv_dtype: torch.dtype,
                                            dtype: torch.dtype, scales: KvScales) -> None:
    # Edge values times the scale (exact for powers of two: they stay edges after x / scale),
    # then random data over many magnitudes; V is K reversed, so each edge goes through both.
    head_dim = 64
    kernel = _kernel(kernel_level, head_dim, 1, dtype, kv_dtype, scales)
    gen = torch.Generator().manual_seed(7)
    edges = edge_values(kv_dtype) * scales.k_scale
    magnitudes = 10.0 ** (torch.rand(4096, generator=gen) * 16 - 10)
    values = torch.cat([edges, torch.randn(4096, generator=gen) * magnitudes])
    values = torch.cat([values, values.new_zeros(-len(values) % head_dim)])
    k = values.view(-1, 1, head_dim).to(dtype)
    v = k.flip(0) * (scales.v_scale / scales.k_scale)
    rows = k.shape[0]
    cache = torch.zeros(2, rows + 1, 4, 1, head_dim, dtype=kv_dtype)
    expected = cache.clone()
    _write(kernel, k, v, cache)
    slots = (torch.arange(rows) + 1) * 4
    write_slots(expected, slots, k, v, scales)
    got, want = cache.view(torch.uint8), expected.view(torch.uint8)
    bad = (got != want).nonzero()
    assert not len(bad), f"{len(bad)} bytes differ, first at {bad[0].tolist()}: " \
                         f"{got[tuple(bad[0])]:#x} != {want[tuple(bad[0])]:#x}"


@FORMATS
@DTYPES
@pytest.mark.parametrize("v_scale", [1.0, 0.37])
@pytest.mark.parametrize("head_dim", [64, 4])        # 4: vec.h's portable read, not F16C
def test_reads_every_byte_exactly(kernel_level: CpuLevel, kv_dtype: torch.dtype,
                                  dtype: torch.dtype, v_scale: float, head_dim: int) -> None:
    # A row of one key has softmax weight exactly 1, so its output is that key's V row read
    # and scaled: every finite byte (subnormals among them) must come out as
    # kv_quant.dequantize makes it, exactly (-0.0 as 0.0: the sum starts at +0). The step's
    # own K/V go to another slot.
    rows = 256 // head_dim
    scales = KvScales(1.0, v_scale)
    kernel = _kernel(kernel_level, head_dim, 1, dtype, kv_dtype, scales)
    every = torch.arange(256, dtype=torch.uint8)
    every[~every.view(kv_dtype).float().isfinite()] = 0
    cache = torch.zeros(2, rows + 1, 4, 1, head_dim, dtype=kv_dtype)
    cache.view(torch.uint8)[1, 1:, 0, 0] = every.view(rows, head_dim)
    q, kv = torch.randn(rows, 1, head_dim).to(dtype), torch.randn(rows, 1, head_dim).to(dtype)
    tables = (torch.arange(rows) + 1)[:, None]                 # key 0: slot 0 of block r + 1
    scratch = (torch.arange(rows) + 1) * 4 + 1                 # the step's own K/V
    out = kernel(q, kv, kv, cache, scratch, tables, torch.arange(rows),
                 torch.ones(rows, dtype=torch.int64))
    expected = dequantize(every.view(kv_dtype), v_scale, dtype).view(rows, head_dim)
    assert torch.equal(out, expected), (out - expected).abs().max()


def _step(query_lens: list[int], context_lens: list[int], block_size: int, num_kv_heads: int,
          group: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, seed: int):
    """Random inputs for one step over a float8 cache of random bytes (finite: K/V of about
    3x the scale's range), with scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 4
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n])
        start += n
    rows = sum(query_lens)
    num_heads = num_kv_heads * group
    qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, generator=gen) * 2
    q, k, v = qkv.to(dtype).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
             * 2).to(kv_dtype)
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, num_blocks,
                                    torch_path=False)
    return q, k, v, cache, tables, meta


@FORMATS
@DTYPES
@pytest.mark.parametrize("group,head_dim", [(1, 128), (3, 64), (4, 64)])
@pytest.mark.parametrize("block_size", [16, 12])
def test_decodes_and_chunks_match_the_reference(kernel_level: CpuLevel, kv_dtype: torch.dtype,
                                                dtype: torch.dtype, group: int, head_dim: int,
                                                block_size: int) -> None:
    # Decodes around the 32-key tile and the blocks, a fresh prompt, chunks after cached
    # context (mid-block and aligned) and a 40-row chunk crossing tiles, in one call.
    query_lens, context_lens = [1, 1, 1, 1, 6, 3, 40], [0, 31, 33, 100, 0, 9, 16]
    scales = KvScales(0.37, 1.9)
    q, k, v, cache, tables, meta = _step(query_lens, context_lens, block_size, 2, group,
                                         head_dim, dtype, kv_dtype, seed=block_size + group)
    kernel = _kernel(kernel_level, head_dim, group, dtype, kv_dtype, scales)
    fast_cache, slow_cache = cache.clone(), cache.clone()
    fast = paged_attention(q, k, v, fast_cache, meta, kernel)
    slow = reference_paged_attention(q, k, v, slow_cache, query_lens, context_lens, tables,
                                     scales=scales)
    assert torch.equal(fast_cache.view(torch.uint8), slow_cache.view(torch.uint8))
    torch.testing.assert_close(fast.float(), slow.float(), **CLOSE[dtype])


@FORMATS
def test_four_lane_heads_read_without_f16c(kernel_level: CpuLevel,
                                           kv_dtype: torch.dtype) -> None:
    # head_dim 4 builds LANES=4, whose reads take vec.h's portable multiply, not F16C.
    query_lens, context_lens = [1, 1, 9], [0, 40, 5]
    scales = KvScales(0.37, 1.9)
    q, k, v, cache, tables, meta = _step(query_lens, context_lens, 16, 2, 2, 4,
                                         torch.float32, kv_dtype, seed=4)
    kernel = _kernel(kernel_level, 4, 2, torch.float32, kv_dtype, scales)
    fast_cache, slow_cache = cache.clone(), cache.clone()
    fast = paged_attention(q, k, v, fast_cache, meta, kernel)
    slow = reference_paged_attention(q, k, v, slow_cache, query_lens, context_lens, tables,
                                     scales=scales)
    assert torch.equal(fast_cache.view(torch.uint8), slow_cache.view(torch.uint8))
    torch.testing.assert_close(fast, slow, **CLOSE[torch.float32])


@FORMATS
@DTYPES
def test_sliding_window_reads_only_its_keys(kernel_level: CpuLevel, kv_dtype: torch.dtype,
                                            dtype: torch.dtype) -> None:
    # Blocks wholly before each request's windows hold NaN bytes (0x7f, read as 480 or 114688
    # times the scale): a read of one would show in the outputs.
    query_lens, context_lens, window = [1, 1, 20], [70, 5, 50], 24
    scales = KvScales(2.5, 0.6)
    q, k, v, cache, tables, meta = _step(query_lens, context_lens, 16, 3, 3, 64, dtype,
                                         kv_dtype, seed=3)
    for table, context in zip(tables, context_lens):
        first = max(0, context + 1 - window)                # the request's earliest row's
        cache.view(torch.uint8)[:, table[:first // 16]] = 0x7f
    kernel = _kernel(kernel_level, 64, 3, dtype, kv_dtype, scales)
    fast_cache, slow_cache = cache.clone(), cache.clone()
    fast = paged_attention(q, k, v, fast_cache, meta, kernel, window=window)
    slow = reference_paged_attention(q, k, v, slow_cache, query_lens, context_lens, tables,
                                     window=window, scales=scales)
    assert torch.equal(fast_cache.view(torch.uint8), slow_cache.view(torch.uint8))
    assert fast.isfinite().all()
    torch.testing.assert_close(fast.float(), slow.float(), **CLOSE[dtype])


@FORMATS
@DTYPES
def test_kernel_path_equals_the_torch_path(kernel_level: CpuLevel, kv_dtype: torch.dtype,
                                           dtype: torch.dtype) -> None:
    # worker_svc.attention end to end: the same cache bytes and outputs. (q is scaled down:
    # in bfloat16 the torch path rounds the scores to bfloat16, as HF's eager attention does,
    # an error that grows with them; the kernel keeps them in float32.)
    query_lens, context_lens = [1] * 6 + [33, 17], [0, 15, 16, 180, 64, 7, 0, 40]
    scales = KvScales(0.8, 1.3)
    q, k, v, cache, _, meta = _step(query_lens, context_lens, 16, 3, 3, 64, dtype, kv_dtype,
                                    seed=11)
    q = q / 4
    torch_meta = build_attention_metadata(query_lens, context_lens, meta.block_table.tolist(),
                                          16, cache.shape[1])
    kernel = _kernel(kernel_level, 64, 3, dtype, kv_dtype, scales)
    fast_cache, slow_cache = cache.clone(), cache.clone()
    fast = paged_attention(q, k, v, fast_cache, meta, kernel)
    slow = paged_attention(q, k, v, slow_cache, torch_meta, None, scales=scales)
    assert torch.equal(fast_cache.view(torch.uint8), slow_cache.view(torch.uint8))
    torch.testing.assert_close(fast.float(), slow.float(), **CLOSE[dtype])


def test_the_cache_dtype_is_checked() -> None:
    level = detect_level()
    kernel = _kernel(level, 16, 2, torch.float32, torch.float8_e4m3fn, KvScales())
    table = torch.ones(1, 1, dtype=torch.int64)
    row, one = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    q, kv = torch.zeros(1, 2, 16), torch.zeros(1, 1, 16)
    for wrong in (torch.float32, torch.float8_e5m2, torch.uint8):
        with pytest.raises(ValueError, match="unexpected"):
            kernel(q, kv, kv, torch.zeros(2, 4, 4, 1, 16, dtype=wrong), one, table, row, one)
    kernel(q, kv, kv, torch.zeros(2, 4, 4, 1, 16, dtype=torch.float8_e4m3fn), one, table, row,
           one)
    # Neither float8 nor the compute dtype: no kernel (the torch path).
    assert paged_attention_kernel(level, 16, 2, torch.float32, torch.bfloat16) is None
    # A cache in the compute dtype reads as stored, whatever scales are passed.
    plain = paged_attention_kernel(level, 16, 2, torch.float32, torch.float32, KvScales(3.0))
    assert plain is not None and plain.kv_scales == KvScales()


@pytest.mark.parametrize("level", [CpuLevel.AVX2, CpuLevel.AVX512, CpuLevel.AVX512_BF16,
                                   CpuLevel.AMX], ids=lambda level: level.label)
def test_fp8_builds_compile_at_every_level(level: CpuLevel, tmp_path: Path) -> None:
    # Built, not loaded (as tests/worker_svc/test_kernel_build.py does for the other builds):
    # levels this CPU lacks still check their code here.
    builds = [("paged_attention.c", {"HEAD_DIM": 64, "GROUP": 3, "LANES": level.lanes,
                                     "ELEM_BF16": bf16, "KV_FP8": fp8})
              for bf16 in (0, 1) for fp8 in (1, 2)]
    if level >= CpuLevel.AMX:
        builds += [("paged_attention_amx.c", {"HEAD_DIM": head_dim, "GROUP": group,
                                              "ELEM_BF16": 1, "KV_FP8": fp8})
                   for head_dim, group in ((64, 3), (128, 8)) for fp8 in (1, 2)]

    def compile_one(i: int, source: str, defines: dict[str, int]) -> None:
        build.compile_only(source, level, defines, tmp_path / f"{i}.so")
        assert (tmp_path / f"{i}.so").stat().st_size > 0

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(compile_one, i, source, defines)
                     for i, (source, defines) in enumerate(builds)]:
            done.result()
