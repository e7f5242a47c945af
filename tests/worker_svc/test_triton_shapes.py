"""The paged-attention kernel (write + attend) at the models' real shapes against its torch
twin: SmolLM2 (9 query / 3 KV heads, head 64), Llama-3.2-1B (32 / 8, head 64) and head 128 with
8 queries per KV head; mixed steps of decode rows and prefill chunks with contexts up to 3,000
keys; and a KV cache past 2^31 elements (int64 offsets). The full sizes and bfloat16 need a GPU
(`gpu`); on a CPU a reduced version (short contexts) runs in fp32 and fp16 under
TRITON_INTERPRET=1, kept to a few seconds."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.worker_svc.test_triton_kernels import (  # noqa: E402
    DEVICE,
    Step,
    assert_close,
    gpu,
)
from worker_svc.triton_kernels.kv_write import write_kv_reference  # noqa: E402
from worker_svc.triton_kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_attention_with_write,
)

# name: (num_heads, num_kv_heads, head_dim)
SHAPES = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64), "head128-gqa8": (32, 4, 128)}
BLOCK_SIZE = 16
# Mixed steps: (query_lens, context_lens). Decode rows first, then prefill chunks.
FULL_STEP = ([1, 1, 1, 1, 37, 128], [2999, 1500, 15, 0, 2900, 700])   # up to 3,000 keys
SMALL_STEP = ([1, 1, 5], [70, 16, 40])                                # the CPU's reduction


def check(step: Step) -> None:
    out, cache = step.run_kernel()
    expected, expected_cache = step.run_twin()
    assert torch.equal(cache, expected_cache)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shapes_reduced(shape: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = SHAPES[shape]
    check(Step(*SMALL_STEP, BLOCK_SIZE, heads, kv_heads, head_dim, dtype, num_padding_rows=1,
               seed=len(shape)))


@pytest.mark.parametrize("shape", ["smollm2", "head128-gqa8"])    # groups of 3 and of 8
def test_real_shapes_reduced_split(shape: str) -> None:
    """The same step with each row's keys split over programs (4 here, to keep the
    interpreted programs few; a GPU runs 16 for a launch this small)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    step = Step(*SMALL_STEP, BLOCK_SIZE, heads, kv_heads, head_dim, torch.float32,
                num_padding_rows=1, seed=len(shape))
    expected, cache = step.run_twin()
    out = paged_attention(step.q, cache, step.block_table, step.row_request, step.kv_lens,
                          step.scale, splits=4)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=gpu)])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="full size needs CUDA")
def test_real_shapes_full_contexts(shape: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = SHAPES[shape]
    check(Step(*FULL_STEP, BLOCK_SIZE, heads, kv_heads, head_dim, dtype, num_padding_rows=3,
               seed=len(shape)))


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=gpu)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 4 GiB cache needs CUDA")
def test_a_cache_past_2_to_the_31_elements(dtype: torch.dtype) -> None:
    # Llama-1B's KV layout, 132,000 blocks of 16: 2 x 132,000 x 16 x 8 x 64 > 2^31 elements
    # in one layer's tensor; the step's blocks lie past the 2^31st element.
    heads, kv_heads, head_dim = SHAPES["llama-1b"]
    num_blocks = 132_000
    assert 2 * num_blocks * BLOCK_SIZE * kv_heads * head_dim > 2 ** 31
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype,
                        device=DEVICE)
    query_lens, context_lens = [1, 1, 20], [300, 47, 100]
    gen = torch.Generator().manual_seed(1)
    tables, rows, lens, slots = [], [], [], []
    for r, (q, c) in enumerate(zip(query_lens, context_lens)):
        need = -(-(q + c) // BLOCK_SIZE)
        table = (num_blocks - 1 - torch.randperm(3000, generator=gen)[:need]).tolist()
        tables.append(table)
        for block in table:
            cache[:, block] = torch.randn(2, BLOCK_SIZE, kv_heads, head_dim, generator=gen
                                          ).to(dtype=dtype, device=DEVICE)
        for pos in range(c, c + q):
            rows.append(r)
            lens.append(pos + 1)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    row_request, kv_lens = (torch.tensor(x, device=DEVICE) for x in (rows, lens))
    slot_mapping = torch.tensor(slots, device=DEVICE)
    n = len(rows)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype=dtype,
                                                                              device=DEVICE)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    expected_cache = cache.clone()
    write_kv_reference(k, v, expected_cache, slot_mapping)
    expected = paged_attention_reference(q, expected_cache, block_table, row_request, kv_lens,
                                         head_dim ** -0.5)
    out = paged_attention_with_write(q, k, v, cache, slot_mapping, block_table, row_request,
                                     kv_lens, head_dim ** -0.5)
    touched = sorted({s // BLOCK_SIZE for s in slots})
    assert torch.equal(cache[:, touched], expected_cache[:, touched])
    assert_close(out, expected)
