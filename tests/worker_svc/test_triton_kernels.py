"""The Triton kernels (worker_svc.triton_kernels) against their torch twins, and the twins
against the model's torch path and the slow attention oracle.

Without CUDA the kernels run in Triton's CPU interpreter, which must be switched on before
triton is imported (the kernels read it when decorated): hence the environment line above
the imports. The interpreter is slow and gets bfloat16 wrong, so shapes are small and the
bfloat16 cases are marked `gpu` and skipped without CUDA; on CUDA every case runs on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from worker_svc.kernels.elementwise import argmax_float  # noqa: E402
from worker_svc.kernels.paged_attention_torch import reference_paged_attention  # noqa: E402
from worker_svc.model.llama import RotaryEmbedding, TorchElementwise  # noqa: E402
from worker_svc.triton_kernels import (  # noqa: E402
    TritonKernels,
    TritonPagedAttention,
    triton_available,
)
from worker_svc.triton_kernels.activation import silu_mul, silu_mul_reference  # noqa: E402
from worker_svc.triton_kernels.kv_write import write_kv, write_kv_reference  # noqa: E402
from worker_svc.triton_kernels.norm import add_rms_norm, add_rms_norm_reference  # noqa: E402
from worker_svc.triton_kernels.paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_attention_with_write,
)
from worker_svc.triton_kernels.rotary import rotary_, rotary_reference_  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 needs CUDA (the "
                          "interpreter computes it wrong)")]
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu)]
# (rtol, atol): float32 differs by summation order only; the others by a rounding or two.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (1.6e-2, 1.6e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


class Step:
    """One mixed step: requests' rows laid out request after request, then padding rows.

    q, k, v are views into one fused qkv tensor (strided rows); the cache holds random
    "already cached" context; block tables are scattered and padded with the null block 0.
    """

    def __init__(self, query_lens: list[int], context_lens: list[int], block_size: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 num_padding_rows: int = 0, seed: int = 0):
        self.query_lens, self.context_lens = query_lens, context_lens
        kv_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        blocks_needed = [-(-n // block_size) for n in kv_lens]
        num_blocks = sum(blocks_needed) + 3                 # the null block and spares
        gen = torch.Generator().manual_seed(seed)
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        max_blocks = max(blocks_needed + [1]) + 1           # a padded column at least
        self.tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
        self.block_table = ints([t + [0] * (max_blocks - len(t)) for t in self.tables])

        row_request, row_kv_lens, slots = [], [], []
        for r, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
            for pos in range(ctx, ctx + q_len):
                row_request.append(r)
                row_kv_lens.append(pos + 1)
                slots.append(self.tables[r][pos // block_size] * block_size + pos % block_size)
        # Padding rows (a CUDA graph's): request 0, nothing to attend, nothing to write.
        row_request += [0] * num_padding_rows
        row_kv_lens += [0] * num_padding_rows
        slots += [-1] * num_padding_rows
        self.row_request, self.kv_lens = ints(row_request), ints(row_kv_lens)
        self.slot_mapping = ints(slots)

        rows = len(slots)
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        qkv = randn(rows, q_width + 2 * kv_width, dtype=dtype, seed=seed + 1)
        self.q = qkv[:, :q_width].view(rows, num_heads, head_dim)
        self.k = qkv[:, q_width:q_width + kv_width].view(rows, num_kv_heads, head_dim)
        self.v = qkv[:, q_width + kv_width:].view(rows, num_kv_heads, head_dim)
        self.kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              seed=seed + 2)
        self.scale = head_dim ** -0.5

    def run_kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, cache after) of the Triton write + attention, on a copy of the cache."""
        cache = self.kv_cache.clone()
        out = paged_attention_with_write(self.q, self.k, self.v, cache, self.slot_mapping,
                                         self.block_table, self.row_request, self.kv_lens,
                                         self.scale)
        return out, cache

    def run_twin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, cache after) of the torch twins, on a copy of the cache."""
        cache = self.kv_cache.clone()
        write_kv_reference(self.k, self.v, cache, self.slot_mapping)
        out = paged_attention_reference(self.q, cache, self.block_table, self.row_request,
                                        self.kv_lens, self.scale)
        return out, cache


# name: (query_lens, context_lens, block_size, num_heads, num_kv_heads, head_dim, padding)
STEPS = {
    # kv_len a multiple of block_size (8), and one past (9 and 5)
    "block_boundaries": ([1, 1, 1], [7, 8, 4], 4, 2, 2, 16, 0),
    # a chunk of 7 tokens starting mid-block at context 5; groups of 3
    "chunk_mid_block": ([7], [5], 4, 6, 2, 16, 0),
    # decodes and prefill chunks of several lengths, groups of 4, padding rows
    "mixed_gqa4": ([1, 1, 3, 6], [9, 0, 2, 0], 4, 8, 2, 16, 2),
    # one-token prefill with no context; a one-block request; group 1
    "one_token_rows": ([1, 1, 2], [0, 3, 0], 4, 1, 1, 32, 1),
    # the model's head size (SmolLM2: 9 heads over 3 KV heads), block 16
    "head_dim_64": ([1, 4], [20, 13], 16, 3, 1, 64, 0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(STEPS))
def test_paged_attention_matches_twin(name: str, dtype: torch.dtype) -> None:
    query_lens, context_lens, block_size, heads, kv_heads, head_dim, padding = STEPS[name]
    step = Step(query_lens, context_lens, block_size, heads, kv_heads, head_dim, dtype,
                num_padding_rows=padding, seed=len(name))
    out, cache = step.run_kernel()
    expected, expected_cache = step.run_twin()
    assert out.shape == (len(step.kv_lens), heads * head_dim) and out.dtype == dtype
    assert torch.equal(cache, expected_cache)
    assert_close(out, expected)
    if padding:
        assert not out[-padding:].any(), "kv_len 0 rows must output zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tile_tokens", [4, 8])
def test_paged_attention_across_tiles(tile_tokens: int, dtype: torch.dtype) -> None:
    """Tiles smaller than the rows' lengths and unaligned with blocks (block_size 6 is not a
    power of two either): the online softmax's rescaling across tiles."""
    step = Step([1, 1, 3], [30, 5, 17], 6, 4, 2, 16, dtype, seed=tile_tokens)
    expected, cache = step.run_twin()
    out = paged_attention(step.q, cache, step.block_table, step.row_request, step.kv_lens,
                          step.scale, tile_tokens=tile_tokens)
    assert_close(out, expected)


def test_paged_attention_matches_slow_oracle() -> None:
    """The kernel against worker_svc.attention's token-by-token reference (CPU tensors)."""
    query_lens, context_lens = [1, 1, 7, 3], [6, 12, 5, 0]
    step = Step(query_lens, context_lens, 4, 6, 2, 16, torch.float32, seed=11)
    out, cache = step.run_kernel()
    oracle_cache = step.kv_cache.cpu().clone()
    expected = reference_paged_attention(step.q.cpu(), step.k.cpu(), step.v.cpu(), oracle_cache,
                                         query_lens, context_lens, step.tables)
    assert torch.equal(cache.cpu(), oracle_cache)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_paged_attention_is_the_c_kernels_call(dtype: torch.dtype) -> None:
    step = Step([1, 2], [3, 4], 4, 4, 2, 16, dtype, num_padding_rows=1, seed=5)
    cache = step.kv_cache.clone()
    kernel = TritonPagedAttention(head_dim=16, group=2, dtype=dtype)
    out = kernel(step.q, step.k, step.v, cache, step.slot_mapping, step.block_table,
                 step.row_request, step.kv_lens)
    expected, expected_cache = step.run_twin()
    assert torch.equal(cache, expected_cache)
    assert_close(out, expected)
    with pytest.raises(ValueError):
        TritonPagedAttention(head_dim=16, group=4, dtype=dtype)(
            step.q, step.k, step.v, cache, step.slot_mapping, step.block_table,
            step.row_request, step.kv_lens)
    with pytest.raises(ValueError):
        TritonPagedAttention(head_dim=48, group=2, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots(dtype: torch.dtype) -> None:
    """Strided k/v views; rows with slot -1 leave the cache as it was."""
    rows, kv_heads, head_dim = 5, 3, 16
    fused = randn(rows, 4 * kv_heads * head_dim, dtype=dtype, seed=3)
    k = fused[:, :kv_heads * head_dim].view(rows, kv_heads, head_dim)
    v = fused[:, 2 * kv_heads * head_dim:3 * kv_heads * head_dim].view(rows, kv_heads, head_dim)
    cache = randn(2, 4, 4, kv_heads, head_dim, dtype=dtype, seed=4)
    slot_mapping = ints([5, -1, 15, 4, -1])
    before = cache.clone()
    write_kv(k, v, cache, slot_mapping)
    expected = before.clone()
    write_kv_reference(k, v, expected, slot_mapping)
    assert torch.equal(cache, expected)
    slots = cache.view(2, 16, kv_heads, head_dim)
    assert torch.equal(slots[0, 15], k[2]) and torch.equal(slots[1, 4], v[3])
    written = torch.zeros(16, dtype=torch.bool)
    written[[5, 15, 4]] = True
    assert torch.equal(slots[:, ~written.to(DEVICE)],
                       before.view(2, 16, kv_heads, head_dim)[:, ~written.to(DEVICE)])


def test_attention_launchers_refuse_bad_arguments() -> None:
    step = Step([1, 2], [3, 0], 4, 4, 2, 16, torch.float32, seed=9)
    q, cache, table = step.q, step.kv_cache, step.block_table
    rr, lens = step.row_request, step.kv_lens
    bad_calls = [
        lambda: paged_attention(q, cache.half(), table, rr, lens, 1.0),        # dtypes differ
        lambda: paged_attention(q.double(), cache.double(), table, rr, lens, 1.0),
        lambda: paged_attention(q[:, :3], cache, table, rr, lens, 1.0),        # 3 over 2 KV
        lambda: paged_attention(q.transpose(1, 2), cache, table, rr, lens, 1.0),
        lambda: paged_attention(q, cache, table.int(), rr, lens, 1.0),
        lambda: paged_attention(q, cache, table, rr, lens[:2], 1.0),
        lambda: paged_attention(q, cache, table, rr.int(), lens, 1.0),
        lambda: paged_attention(q, cache.transpose(3, 4), table, rr, lens, 1.0),
        lambda: paged_attention(q, cache, table, rr, lens, 1.0, tile_tokens=6),
        lambda: write_kv(step.k, step.v, cache, step.slot_mapping.int()),
        lambda: write_kv(step.k, step.v.half(), cache, step.slot_mapping),
        lambda: write_kv(step.k[:, :1], step.v[:, :1], cache, step.slot_mapping),
        lambda: write_kv(step.k.transpose(1, 2), step.v, cache, step.slot_mapping),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} was accepted")
    odd = randn(2, 2, 2, 1, 24, dtype=torch.float32, seed=1)                # head_dim 24
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(randn(1, 1, 24, dtype=torch.float32, seed=2), odd, table, rr[:1],
                        lens[:1], 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 100])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_twin(dtype: torch.dtype, dim: int, with_residual: bool) -> None:
    x = randn(3, dim, dtype=dtype, seed=dim)
    residual = randn(3, dim, dtype=dtype, seed=dim + 1) if with_residual else None
    weight = randn(dim, dtype=dtype, seed=dim + 2)
    new_residual, normed = add_rms_norm(x, residual, weight, 1e-5)
    expected_residual, expected = add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)
    assert new_residual.data_ptr() != x.data_ptr()
    assert_close(normed, expected)
    # The twin is the model's torch path (F.rms_norm, itself float32 inside).
    torch_residual, torch_normed = TorchElementwise.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(expected_residual, torch_residual)
    assert_close(expected, torch_normed)
    assert_close(normed, TritonKernels().add_rms_norm(x, residual, weight, 1e-5)[1])


def test_add_rms_norm_refuses_bad_arguments() -> None:
    x = randn(2, 8, dtype=torch.float32, seed=0)
    weight = randn(8, dtype=torch.float32, seed=1)
    for call in [lambda: add_rms_norm(x.t().contiguous().t(), None, weight, 1e-5),
                 lambda: add_rms_norm(x, None, weight[:4], 1e-5),
                 lambda: add_rms_norm(x, x.half(), weight, 1e-5),
                 lambda: add_rms_norm(x, x[:1], weight, 1e-5),
                 lambda: add_rms_norm(x.new_zeros(1, 8193), None, x.new_zeros(8193), 1e-5)]:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(16, 2, 1), (24, 3, 1),
                                                              (256, 16, 2)])
def test_rotary_matches_twin(dtype: torch.dtype, head_dim: int, num_heads: int,
                             num_kv_heads: int) -> None:
    """On the q and k heads of fused qkv rows inside a wider buffer (strided rows); v and
    the rest of the buffer stay as they were. Rotated heads 3 and 4: padded head tiles;
    head_dim 24: halves of 12, padded; 18 heads of 256: two programs a row."""
    rows = 4
    rope = RotaryEmbedding(head_dim, 10000.0, 64, dtype)
    cos, sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    positions = ints([0, 5, 63, 17])
    width = (num_heads + 2 * num_kv_heads) * head_dim
    buffer = randn(rows, width + 8, dtype=dtype, seed=head_dim)
    x = buffer[:, :width]
    rotated = num_heads + num_kv_heads
    out, expected = buffer.clone(), buffer.clone()
    rotary_(out[:, :width], rotated, head_dim, positions, cos, sin)
    rotary_reference_(expected[:, :width], rotated, head_dim, positions, cos, sin)
    assert_close(out, expected)
    assert torch.equal(out[:, rotated * head_dim:], buffer[:, rotated * head_dim:])
    # The twin is exactly the model's torch path.
    model_path = x.clone()
    TorchElementwise.rotary_(model_path, rotated, head_dim, positions, cos, sin)
    assert torch.equal(expected[:, :width], model_path)
    triton_path = x.clone()
    TritonKernels().rotary_(triton_path, rotated, head_dim, positions, cos, sin)
    assert torch.equal(triton_path, out[:, :width])


def test_rotary_refuses_bad_arguments() -> None:
    x = randn(2, 32, dtype=torch.float32, seed=0)
    rope = RotaryEmbedding(16, 10000.0, 8, torch.float32)
    cos, sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    positions = ints([0, 1])
    for call in [lambda: rotary_(x, 3, 16, positions, cos, sin),             # too wide
                 lambda: rotary_(x, 2, 15, positions, cos[:, :15], sin[:, :15]),
                 lambda: rotary_(x, 2, 16, positions.int(), cos, sin),
                 lambda: rotary_(x, 2, 16, positions[:1], cos, sin),
                 lambda: rotary_(x, 2, 16, positions, cos.half(), sin.half()),
                 lambda: rotary_(x.t(), 1, 2, positions, cos[:, :2], sin[:, :2])]:
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 100])
def test_silu_mul_matches_twin(dtype: torch.dtype, inter: int) -> None:
    """1536: SmolLM2's, two programs a row; 100: padded."""
    gate_up = randn(3, 2 * inter, dtype=dtype, seed=inter)
    out = silu_mul(gate_up)
    expected = silu_mul_reference(gate_up)
    assert out.shape == (3, inter) and out.dtype == dtype
    assert_close(out, expected)
    assert_close(expected, TorchElementwise.silu_mul(gate_up))
    assert torch.equal(TritonKernels().silu_mul(gate_up), out)


def test_silu_mul_refuses_bad_arguments() -> None:
    gate_up = randn(2, 8, dtype=torch.float32, seed=0)
    for call in [lambda: silu_mul(gate_up[:, :7]), lambda: silu_mul(gate_up.t()),
                 lambda: silu_mul(gate_up.int()), lambda: silu_mul(gate_up[0])]:
        with pytest.raises(ValueError):
            call()


def test_argmax_and_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = randn(3, 50, dtype=torch.float16, seed=0)
    assert torch.equal(TritonKernels().argmax(logits), argmax_float(logits))
    assert triton_available()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert not triton_available()
