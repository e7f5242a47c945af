"""Sliding-window attention in every kernel set (the torch path, `paged_attention.c` at every
CPU level this machine has, `paged_attention_amx.c`, the Triton kernel) against a plain
reference: per row, a float64 softmax over exactly the keys [max(0, L - W), L).

Every windowed step is set up as kvcache_svc will leave it: the blocks wholly before a
request's first window start are freed, so its table holds the null block (id 0) there, and
the null block holds NaN. The kernels must then never read those blocks (0 * NaN is NaN); for
them every other slot no row may read (keys before a row's window in the start's block, slots
past its length) holds NaN too. The torch path reads whole blocks from the window start's
block (finite stale keys), so for it only the null block is poisoned.

Tolerances: float32 differs from float64 by summation order (1e-5); bfloat16 by the output's
own rounding (2^-9 relative) plus the inputs to the products rounded to bfloat16 (the AMX
kernel's P, the torch path's scores): 1.6e-2 absolute and relative, as the AMX tests; float16
(Triton) 2e-3.
"""

import os
import shutil

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (see there)

import pytest  # noqa: E402

from worker_svc.attention import build_attention_metadata, paged_attention  # noqa: E402
from worker_svc.kernels.cpu import CpuLevel, detect_level  # noqa: E402
from worker_svc.kernels.paged_attention import (  # noqa: E402
    AmxPagedAttentionKernel,
    paged_attention_kernel,
)
from worker_svc.kernels.paged_attention_torch import reference_paged_attention  # noqa: E402

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler")
needs_amx = pytest.mark.skipif(not HAS_CC or detect_level() < CpuLevel.AMX,
                               reason="needs a C compiler and CPU level amx")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# name: (query_lens, context_lens); decodes first, as the metadata wants them
STEPS = {
    # contexts below, at and past blocks of 8 and 16 and any window
    "decodes": ([1] * 6, [0, 5, 15, 16, 40, 130]),
    # a chunk whose first rows see keys of earlier chunks and whose later rows' windows start
    # inside the chunk
    "chunk_across_edge": ([20], [30]),
    # decodes beside a fresh prompt and a chunk after cached tokens (mid-block)
    "mixed": ([1, 1, 1, 12, 33], [3, 70, 200, 0, 50]),
}
# smaller than a block, a block of 8, a block of 16, not a multiple of 16, more than any
# context (= full attention), and none
WINDOWS = [5, 8, 16, 23, 1000, 0]


class Step:
    """One step's inputs and its cache (K/V of earlier tokens random), with blocks wholly
    before each request's first window start freed to the null block."""

    def __init__(self, query_lens: list[int], context_lens: list[int], block_size: int,
                 num_kv_heads: int, group: int, head_dim: int, window: int,
                 dtype: torch.dtype, poison_stale: bool, seed: int = 0):
        self.query_lens, self.context_lens, self.window = query_lens, context_lens, window
        gen = torch.Generator().manual_seed(seed)
        kv_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        need = [-(-n // block_size) for n in kv_lens]
        num_blocks = sum(need) + 2
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables, taken = [], 0
        for n in need:
            self.tables.append(ids[taken:taken + n])
            taken += n
        cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
        self.freed = 0
        if window:                        # kvcache_svc's null block holds garbage
            cache[:, 0] = float("nan")
        for table, ctx, n in zip(self.tables, context_lens, kv_lens):
            start = max(0, ctx + 1 - window) if window else 0   # the first row's window
            if poison_stale:              # no kernel may read a slot outside every window
                slots = cache[:, table].view(2, -1, num_kv_heads, head_dim)
                slots[:, :start] = float("nan")
                slots[:, n:] = float("nan")
                cache[:, table] = slots.view(2, len(table), block_size, num_kv_heads,
                                             head_dim)
            for b in range(start // block_size):
                table[b] = 0
                self.freed += 1
        self.cache = cache.to(dtype)
        rows, num_heads = sum(query_lens), num_kv_heads * group
        qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        # q as a slice of a wider tensor, as the model passes it (rows strided)
        self.q, self.k, self.v = qkv.to(dtype).split([num_heads, num_kv_heads, num_kv_heads],
                                                     dim=1)
        self.num_blocks = num_blocks

    def meta(self, torch_path: bool):  # type: ignore[no-untyped-def]
        return build_attention_metadata(self.query_lens, self.context_lens, self.tables,
                                        self.cache.shape[2], self.num_blocks, torch_path)

    def expected(self, cache: torch.Tensor) -> torch.Tensor:
        """The plain reference over `cache` (the step's K/V already written)."""
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        num_heads = self.q.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty(self.q.shape[0], num_heads, head_dim, dtype=torch.float64)
        row = 0
        for q_len, ctx, table in zip(self.query_lens, self.context_lens, self.tables):
            for i in range(q_len):
                n = ctx + i + 1
                keys = range(max(0, n - self.window) if self.window else 0, n)
                slots = [(table[t // block_size], t % block_size) for t in keys]
                k = torch.stack([cache[0, b, o] for b, o in slots]).double()   # [n, kvh, d]
                v = torch.stack([cache[1, b, o] for b, o in slots]).double()
                q = self.q[row].double().view(num_kv_heads, group, head_dim)
                scores = torch.einsum("hgd,nhd->hgn", q, k) * head_dim ** -0.5
                out[row] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(
                    num_heads, head_dim)
                row += 1
        return out.reshape(self.q.shape[0], -1)

    def check(self, out: torch.Tensor, cache: torch.Tensor) -> None:
        assert out.dtype == self.q.dtype and not out.isnan().any()
        tol = TOLERANCE[self.q.dtype]
        torch.testing.assert_close(out.double(), self.expected(cache), atol=tol, rtol=tol)


def _step(name: str, block_size: int, window: int, dtype: torch.dtype, poison_stale: bool,
          num_kv_heads: int = 3, group: int = 3, head_dim: int = 64) -> Step:
    query_lens, context_lens = STEPS[name]
    step = Step(query_lens, context_lens, block_size, num_kv_heads, group, head_dim, window,
                dtype, poison_stale, seed=len(name) + window)
    if window and window < 16 and name == "decodes":
        assert step.freed, "the step frees no block: it tests nothing of the null block"
    return step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(STEPS))
def test_torch_path(name: str, window: int, block_size: int, dtype: torch.dtype) -> None:
    step = _step(name, block_size, window, dtype, poison_stale=False)
    cache = step.cache.clone()
    meta = step.meta(torch_path=True)
    out = paged_attention(step.q, step.k, step.v, cache, meta, window=window)
    step.check(out, cache)
    assert list(meta.windows) == ([window] if window else [])


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(STEPS))
def test_c_kernel(kernel_level: CpuLevel, name: str, window: int, block_size: int,
                  dtype: torch.dtype) -> None:
    # At level amx in bfloat16 with blocks of 16 this is paged_attention_amx.c, else
    # paged_attention.c compiled for the level.
    step = _step(name, block_size, window, dtype, poison_stale=True)
    kernel = paged_attention_kernel(kernel_level, 64, 3, dtype)
    assert kernel is not None
    cache = step.cache.clone()
    out = paged_attention(step.q, step.k, step.v, cache, step.meta(torch_path=False), kernel,
                          window)
    step.check(out, cache)


@needs_amx
@pytest.mark.parametrize("group,head_dim", [(3, 64), (8, 128), (1, 32)])
@pytest.mark.parametrize("window", [5, 16, 17, 40, 1000])
def test_amx_kernel_and_its_twin(group: int, head_dim: int, window: int) -> None:
    # Query tiles of several prefill rows with different window starts (group 1: 16 rows a
    # tile; 8: 2 rows), a chunk longer than a work item, decodes.
    query_lens, context_lens = [1, 1, 70, 19], [33, 300, 40, 0]
    step = Step(query_lens, context_lens, 16, 2, group, head_dim, window, torch.bfloat16,
                poison_stale=True, seed=window + group)
    kernel = paged_attention_kernel(CpuLevel.AMX, head_dim, group, torch.bfloat16)
    assert isinstance(kernel, AmxPagedAttentionKernel)
    meta = step.meta(torch_path=False)
    amx_cache, twin_cache = step.cache.clone(), step.cache.clone()
    got = paged_attention(step.q, step.k, step.v, amx_cache, meta, kernel, window)
    twin = paged_attention(step.q, step.k, step.v, twin_cache, meta, kernel.twin(), window)
    assert torch.equal(amx_cache.view(torch.int16), twin_cache.view(torch.int16))
    step.check(got, amx_cache)
    step.check(twin, twin_cache)


@needs_cc
def test_window_covering_every_key_is_full_attention_bit_for_bit(kernel_level: CpuLevel
                                                                 ) -> None:
    query_lens, context_lens = STEPS["mixed"]
    for dtype in (torch.float32, torch.bfloat16):
        step = Step(query_lens, context_lens, 16, 3, 3, 64, 0, dtype, poison_stale=False)
        kernel = paged_attention_kernel(kernel_level, 64, 3, dtype)
        meta = step.meta(torch_path=False)
        full = paged_attention(step.q, step.k, step.v, step.cache.clone(), meta, kernel)
        wide = paged_attention(step.q, step.k, step.v, step.cache.clone(), meta, kernel, 233)
        assert torch.equal(full, wide)


def test_torch_path_keeps_one_entry_per_window_for_the_step() -> None:
    step = _step("mixed", 16, 23, torch.float32, poison_stale=False)
    meta = step.meta(torch_path=True)
    outs = {}
    for window in (23, 5, 23, 0, 5):          # layers of a hybrid model, in turn
        cache = step.cache.clone()
        step.window = window
        outs.setdefault(window, []).append(
            paged_attention(step.q, step.k, step.v, cache, meta, window=window))
        if window == 23:
            step.check(outs[window][-1], cache)
    assert sorted(meta.windows) == [5, 23]
    assert torch.equal(outs[5][0], outs[5][1]) and torch.equal(outs[23][0], outs[23][1])
    assert not torch.equal(outs[5][0], outs[23][0])


@pytest.mark.parametrize("window", [3, 7, 100])
def test_slow_reference_takes_the_window(window: int) -> None:
    step = Step([1, 1, 9], [6, 17, 5], 4, 2, 2, 16, window, torch.float32, poison_stale=False)
    cache = step.cache.clone()
    out = reference_paged_attention(step.q, step.k, step.v, cache, step.query_lens,
                                    step.context_lens, step.tables, window)
    step.check(out, cache)


def test_negative_window_is_refused() -> None:
    step = _step("decodes", 16, 0, torch.float32, poison_stale=False)
    with pytest.raises(ValueError):
        paged_attention(step.q, step.k, step.v, step.cache, step.meta(True), window=-1)


# The Triton kernel in the interpreter (slow: tiny shapes; bfloat16 is wrong there).
# splits 1: the single pass (the interpreter's default); 4: keys split over programs (the GPU
# runs 16 for a step this small; 4 keeps the interpreted programs few)
@pytest.mark.parametrize("window,tile_tokens,dtype,splits", [
    *((w, t, d, 1) for w, t in [(3, 4), (4, None), (7, 4), (100, None)]
      for d in (torch.float32, torch.float16)),
    (3, 4, torch.float32, 4), (7, 4, torch.float32, 4), (100, None, torch.float16, 4)])
def test_triton_kernel(window: int, tile_tokens: int | None, dtype: torch.dtype,
                       splits: int) -> None:
    pytest.importorskip("triton")
    from worker_svc.triton_kernels import TritonPagedAttention, triton_available
    from worker_svc.triton_kernels.kv_write import write_kv
    from worker_svc.triton_kernels.paged_attention import (
        default_splits,
        paged_attention_reference,
    )
    from worker_svc.triton_kernels.paged_attention import paged_attention as triton_attention
    if not triton_available():
        pytest.skip("triton cannot run here")
    step = Step([1, 1, 6], [9, 2, 5], 4, 2, 2, 16, window, dtype, poison_stale=True,
                seed=window)
    meta = step.meta(torch_path=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = step.cache.to(device)
    args = [t.to(device) for t in (meta.block_table, meta.row_request, meta.row_kv_lens)]
    write_kv(step.k.to(device), step.v.to(device), cache, meta.slot_mapping.to(device))
    out = triton_attention(step.q.to(device), cache, *args, 16 ** -0.5, window,
                           tile_tokens=tile_tokens, splits=splits)
    step.check(out.cpu(), cache.cpu())
    twin = paged_attention_reference(step.q.to(device), cache, *args, 16 ** -0.5, window)
    step.check(twin.cpu(), cache.cpu())
    # The drop-in for the C kernel's call, as a layer makes it.
    layer_cache = step.cache.to(device)
    layer = TritonPagedAttention(16, 2, dtype)(
        step.q.to(device), step.k.to(device), step.v.to(device), layer_cache,
        meta.slot_mapping.to(device), *args, window)
    if tile_tokens is None and splits == default_splits(len(meta.row_kv_lens)):
        assert torch.equal(layer.cpu(), out.cpu())
    step.check(layer.cpu(), layer_cache.cpu())
