"""The Triton attention's split across programs (flash-decoding): a row's keys in runs of
tiles over several programs, combined by a second kernel; the launcher's choice of splits;
and the split kernel's experimental tl.dot products. Shared set-up (interpreter, `Step`,
tolerances) from test_triton_kernels.py; the real shapes' split case is in
test_triton_shapes.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.worker_svc.test_triton_kernels import DTYPES, Step, assert_close  # noqa: E402
from worker_svc.triton_kernels.paged_attention import paged_attention  # noqa: E402


@pytest.mark.parametrize("splits,dtype", [(1, torch.float32), (2, torch.float32),
                                          (16, torch.float32), (2, torch.float16)])
def test_paged_attention_split_across_programs(splits: int, dtype: torch.dtype) -> None:
    """A row's keys split over programs (flash-decoding) and combined: runs of several tiles
    (30 keys in tiles of 4 over 2 splits), splits with no keys (5 keys over 16), a row with
    one key, and padding rows (no keys at all) that must come out zero."""
    step = Step([1, 1, 3, 1], [30, 5, 17, 0], 6, 4, 2, 16, dtype, num_padding_rows=2,
                seed=splits)
    expected, cache = step.run_twin()
    out = paged_attention(step.q, cache, step.block_table, step.row_request, step.kv_lens,
                          step.scale, tile_tokens=4, splits=splits)
    assert_close(out, expected)
    assert not out[-2:].any(), "kv_len 0 rows must output zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 4, 128), (4, 2, 16)])
def test_paged_attention_dot_variant(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The split kernel's experimental tl.dot products (SPLITSERVE_TRITON_DOT_ATTENTION):
    query heads padded to 16 rows, tiles of at least 16 keys, several tiles per split,
    padding rows zero."""
    heads, kv_heads, head_dim = shape
    step = Step([1, 1, 5], [70, 16, 40], 16, heads, kv_heads, head_dim, dtype,
                num_padding_rows=1, seed=head_dim)
    expected, cache = step.run_twin()
    out = paged_attention(step.q, cache, step.block_table, step.row_request, step.kv_lens,
                          step.scale, splits=2, dot=True)
    assert_close(out, expected)
    assert not out[-1].any()
    with pytest.raises(ValueError, match="tile_tokens"):
        paged_attention(step.q, cache, step.block_table, step.row_request, step.kv_lens,
                        step.scale, splits=2, dot=True, tile_tokens=8)


def test_paged_attention_splits_only_small_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a launch of at most _SPLIT_MAX_ROWS rows splits each row's keys over _SPLITS
    programs and a larger one runs the single pass (the interpreter always runs the single
    pass unless asked); a row's result does not depend on how many rows share its launch (a
    padded decode graph and the eager step agree)."""
    import worker_svc.triton_kernels.paged_attention as module

    step = Step([1, 1, 2], [30, 5, 17], 6, 4, 2, 16, torch.float32, num_padding_rows=1, seed=7)
    _, cache = step.run_twin()
    args = (step.q, cache, step.block_table, step.row_request, step.kv_lens, step.scale)
    rows = step.q.shape[0]
    split = paged_attention(*args, splits=module._SPLITS)
    single = paged_attention(*args, splits=1)
    monkeypatch.setattr(module, "interpreting", lambda: True)
    assert module.default_splits(1) == 1
    monkeypatch.setattr(module, "interpreting", lambda: False)
    assert module.default_splits(module._SPLIT_MAX_ROWS) == module._SPLITS
    assert module.default_splits(module._SPLIT_MAX_ROWS + 1) == 1
    monkeypatch.setattr(module, "_SPLIT_MAX_ROWS", rows)
    assert torch.equal(paged_attention(*args), split)
    fewer = paged_attention(step.q[:3], cache, step.block_table, step.row_request[:3],
                            step.kv_lens[:3], step.scale)
    assert torch.equal(fewer, split[:3])
    monkeypatch.setattr(module, "_SPLIT_MAX_ROWS", rows - 1)
    assert torch.equal(paged_attention(*args), single)
    with pytest.raises(ValueError, match="splits"):
        paged_attention(*args, splits=3)
