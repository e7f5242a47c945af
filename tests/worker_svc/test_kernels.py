"""The C paged-attention kernel against the slow reference, and how it is built and cached."""

import fnmatch
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker_svc import kernels
from worker_svc.attention import build_attention_metadata, paged_attention
from worker_svc.kernels import build
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.elementwise import elementwise_kernels
from worker_svc.kernels.paged_attention import paged_attention_kernel
from worker_svc.kernels.paged_attention_torch import reference_paged_attention

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the kernels fall back to torch")


def _kernel(level: CpuLevel, head_dim: int, group: int, dtype: torch.dtype
            ) -> kernels.PagedAttentionKernel:
    kernel = paged_attention_kernel(level, head_dim, group, dtype)
    assert kernel is not None, "the kernel did not build (see the log)"
    return kernel


def _attend(level: CpuLevel, query_lens: list[int], context_lens: list[int], block_size: int,
            num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel path, reference) outputs for requests with fresh, scattered block tables."""
    gen = torch.Generator().manual_seed(len(query_lens) * 7 + sum(context_lens) + head_dim)
    kv_lens = [c + q for c, q in zip(context_lens, query_lens)]
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 8
    # Scattered, non-increasing block ids: request i takes every len(query_lens)-th id.
    ids = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables, start = [], 0
    for n in need:
        tables.append([1 + b for b in ids[start:start + n]])
        start += n
    num_tokens = sum(query_lens)
    # q as a slice of a wider tensor, as the model passes it (rows strided, heads contiguous).
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
    q = qk[:, :num_heads]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    cache = cache.to(dtype)
    cache[:, 0] = 0
    fast_cache, slow_cache = cache.clone(), cache.clone()
    meta = build_attention_metadata(query_lens, context_lens, tables, block_size, num_blocks,
                                    torch_path=False)
    kernel = _kernel(level, head_dim, num_heads // num_kv_heads, dtype)
    fast = paged_attention(q, k, v, fast_cache, meta, kernel)
    slow = reference_paged_attention(q, k, v, slow_cache, query_lens, context_lens, tables)
    assert torch.equal(fast_cache, slow_cache)
    return fast, slow


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16),
                                                              (8, 2, 32), (6, 2, 8), (4, 2, 4)])
def test_float32_decodes_match_reference(kernel_level: CpuLevel, num_heads: int,
                                         num_kv_heads: int, head_dim: int) -> None:
    # Contexts around the kernel's 32-token tile and the 16-token block: 0, 31, 32, 33, 100.
    contexts = [0, 31, 32, 33, 100, 7]
    fast, slow = _attend(kernel_level, [1] * len(contexts), contexts, 16, num_heads,
                         num_kv_heads, head_dim, torch.float32)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_chunks_beside_decodes(kernel_level: CpuLevel, block_size: int) -> None:
    # Fresh prompts, chunks after cached context (mid-block and aligned) and a 70-token chunk
    # whose later rows cross tiles: every row is causal by its own length.
    fast, slow = _attend(kernel_level, [1, 1, 1, 6, 3, 5, 70], [5, 70, 0, 0, 9, 16, 40],
                         block_size, 6, 2, 16, torch.float32)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_reference(kernel_level: CpuLevel) -> None:
    contexts = [3, 40, 129, 64, 0]
    fast, slow = _attend(kernel_level, [1] * 4 + [20], contexts, 16, 9, 3, 64, torch.bfloat16)
    torch.testing.assert_close(fast.float(), slow.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_alone_or_in_a_large_batch(kernel_level: CpuLevel,
                                                     dtype: torch.dtype) -> None:
    # A large batch hands a row's KV heads to a thread as one item, a small one each head
    # alone; each head's sums run in the same order either way, so the bits match.
    kernel = _kernel(kernel_level, 64, 3, dtype)
    gen = torch.Generator().manual_seed(11)
    rows, block, blocks_per_row = 24, 16, 4
    num_blocks = rows * blocks_per_row + 1
    cache = torch.randn(2, num_blocks, block, 3, 64, generator=gen).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(rows, blocks_per_row)
    kv_lens = torch.randint(1, block * blocks_per_row + 1, (rows,), generator=gen)
    slots = tables.gather(1, ((kv_lens - 1) // block)[:, None])[:, 0] * block \
        + (kv_lens - 1) % block
    q = torch.randn(rows, 9, 64, generator=gen).to(dtype)
    k, v = (torch.randn(rows, 3, 64, generator=gen).to(dtype) for _ in range(2))
    batch = kernel(q, k, v, cache.clone(), slots, tables, torch.arange(rows), kv_lens)
    alone = kernel(q[:1], k[:1], v[:1], cache.clone(), slots[:1], tables,
                   torch.zeros(1, dtype=torch.int64), kv_lens[:1])
    assert torch.equal(batch[:1], alone)


def test_long_context_and_large_scores_stay_finite(kernel_level: CpuLevel) -> None:
    # 3000 keys and scores in the hundreds: the running max must keep exp() in range.
    kernel = _kernel(kernel_level, 16, 2, torch.float32)
    gen = torch.Generator().manual_seed(5)
    n, block = 3000, 16
    blocks = -(-n // block)
    cache = torch.randn(2, blocks + 1, block, 1, 16, generator=gen) * 6
    q = torch.randn(1, 2, 16, generator=gen) * 6
    table = torch.arange(1, blocks + 1, dtype=torch.int64)[None]
    k_new, v_new = torch.randn(2, 1, 1, 16, generator=gen) * 6    # the query token's own
    slot = torch.tensor([block + n - 1])                            # position n - 1
    out = kernel(q, k_new, v_new, cache, slot, table, torch.zeros(1, dtype=torch.int64),
                 torch.tensor([n]))
    keys = cache[0, 1:].reshape(-1, 16)[:n]
    values = cache[1, 1:].reshape(-1, 16)[:n]
    assert torch.equal(keys[-1], k_new[0, 0]) and torch.equal(values[-1], v_new[0, 0])
    expected = torch.softmax(q[0] @ keys.T / 4, dim=-1) @ values
    torch.testing.assert_close(out.view(2, 16), expected, atol=1e-4, rtol=1e-4)


def test_rejects_mismatched_tensors() -> None:
    kernel = _kernel(detect_level(), 16, 2, torch.float32)
    cache = torch.zeros(2, 4, 4, 1, 16)
    table = torch.ones(1, 1, dtype=torch.int64)
    row, one = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    kv = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="unexpected"):           # 3 heads: not 2 per KV head
        kernel(torch.zeros(1, 3, 16), kv, kv, cache, one, table, row, one)
    with pytest.raises(ValueError, match="unexpected"):
        kernel(torch.zeros(1, 2, 16), kv, kv, cache.bfloat16(), one, table, row, one)
    with pytest.raises(ValueError, match="unexpected"):
        kernel(torch.zeros(1, 2, 16), kv, kv, cache, one, table, row.int(), one)
    with pytest.raises(ValueError, match="unexpected"):           # two rows of K for one query
        kernel(torch.zeros(1, 2, 16), torch.zeros(2, 1, 16), kv, cache, one, table, row, one)


def test_build_is_cached_by_content(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_libraries", {})
    level = detect_level()
    assert paged_attention_kernel(level, 16, 2, torch.float32) is not None
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("paged_attention-") and built[0].endswith(".so")
    monkeypatch.setattr(build, "_libraries", {})
    assert paged_attention_kernel(level, 16, 2, torch.float32) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == built, "built twice"
    assert paged_attention_kernel(level, 16, 2, torch.bfloat16) is not None
    assert len(list(tmp_path.iterdir())) == 2


def test_no_compiler_or_level_none_falls_back(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SPLITSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(build, "_warned", set())
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert paged_attention_kernel(detect_level(), 16, 2, torch.float32) is None
    assert "no C compiler" in caplog.text
    monkeypatch.undo()
    assert paged_attention_kernel(detect_level(), 10, 2, torch.float32) is None  # 10 % 4 != 0
    assert paged_attention_kernel(CpuLevel.NONE, 16, 2, torch.float32) is None


# ------------------------------------------------------------------------ elementwise kernels

def _elementwise(dtype: torch.dtype, level: CpuLevel | None = None
                 ) -> kernels.ElementwiseKernels:
    ew = elementwise_kernels(detect_level() if level is None else level, dtype)
    assert ew is not None, "the elementwise kernels did not build (see the log)"
    return ew


def _close(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [576, 13])            # 13: the scalar tail only
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_torch(kernel_level: CpuLevel, dtype: torch.dtype, dim: int,
                                    with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(70, dim, generator=gen) * 3).to(dtype)
    residual = torch.randn(70, dim, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(dim, generator=gen).to(dtype)
    new_residual, normed = _elementwise(dtype, kernel_level).add_rms_norm(x, residual, weight, 1e-5)
    expected_residual = x if residual is None else x + residual
    assert torch.equal(new_residual, expected_residual)       # rounded exactly as torch
    expected = F.rms_norm(expected_residual.float(), (dim,), weight.float(), 1e-5)
    torch.testing.assert_close(normed.float(), expected, **_close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(kernel_level: CpuLevel, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(33, 2 * 1539, generator=gen) * 8).to(dtype)   # tail of 3
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])             # far and at zero
    out = _elementwise(dtype, kernel_level).silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **_close(dtype))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 8])
def test_rotary_in_place_matches_torch(kernel_level: CpuLevel, dtype: torch.dtype,
                                       head_dim: int) -> None:
    from worker_svc.model.llama import RotaryEmbedding, apply_rotary, rotary_rows

    heads, kv_heads, rows = 9, 3, 21
    rope = RotaryEmbedding(head_dim, 10000.0, 512, dtype)
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (rows,), generator=gen)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    rows_cos_sin = rotary_rows(rope.cos, rope.sin, positions)
    expected = apply_rotary(qk.float(), *(t.float() for t in rows_cos_sin))
    values = qkv[:, (heads + kv_heads) * head_dim:].clone()
    _elementwise(dtype, kernel_level).rotary_(qkv, heads + kv_heads, head_dim, positions,
                                              rope.cos, rope.sin)
    torch.testing.assert_close(qk.float(), expected, **_close(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], values), "values were touched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [49152, 1003])        # 1003: a scalar tail of 11
def test_argmax_matches_torch(kernel_level: CpuLevel, dtype: torch.dtype, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(67, cols, generator=gen) * 4).to(dtype)
    # Ties keep the first column (bfloat16 logits tie often); the maximum in the tail; a row
    # of -inf; NaN counts as the largest, as in torch; -0.0 and 0.0 are equal.
    x[1, 5] = x[1, 700] = x[1, cols - 1] = 100.0
    x[2, cols - 1] = 100.0
    x[3] = float("-inf")
    x[4, 9] = x[4, 800] = float("nan")
    x[5] = -1.0
    x[5, 40], x[5, 30] = 0.0, -0.0
    got = _elementwise(dtype, kernel_level).argmax(x)
    expected = x.float().argmax(dim=-1)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected), (got[:6].tolist(), expected[:6].tolist())
    assert got[:6].tolist() == [expected[0].item(), 5, cols - 1, 0, 9, 30]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_across_lanes_and_short_rows(kernel_level: CpuLevel,
                                                 dtype: torch.dtype) -> None:
    # Few distinct values: the maximum sits in several lanes and vectors at once.
    gen = torch.Generator().manual_seed(5)
    for cols in (1, 5, 16, 17, 33, 100):
        x = torch.randint(-3, 3, (40, cols), generator=gen).to(dtype)
        got = _elementwise(dtype, kernel_level).argmax(x)
        assert torch.equal(got, x.float().argmax(dim=-1)), cols


def test_argmax_rejects_what_it_cannot_read() -> None:
    ew = _elementwise(torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        ew.argmax(torch.zeros(4, 8, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="expected contiguous"):
        ew.argmax(torch.zeros(4, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="rows, cols"):
        ew.argmax(torch.zeros(4, 0, dtype=torch.bfloat16))


def test_package_data_ships_every_kernel_file() -> None:
    # A non-editable install (the Docker image) carries only what package-data names: a
    # source or header left out makes every build fail there, silently slow (torch path).
    root = Path(kernels.__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["worker_svc"]
    sources = sorted(build.SOURCE_DIR.glob("*.c"))
    needed = {p.name for p in sources}
    for source in sources:
        needed |= set(re.findall(r'#include "([^"]+)"', source.read_text()))
    for name in sorted(needed):
        assert (build.SOURCE_DIR / name).exists(), name
        assert any(fnmatch.fnmatch(f"kernels/{name}", pat) for pat in patterns), \
            f"{name} is not in pyproject's package-data"
