"""KV group layout and sizing (services.kv_groups): uniform and hybrid models, stages that
split a group, and the blocks a sliding window keeps."""

import itertools

import pytest

from services.kv_groups import (
    FULL_ATTENTION,
    KvGroupLayout,
    first_needed_block,
    first_needed_token,
    max_blocks_in_window,
)


def test_a_uniform_model_is_one_group_with_a_tensor_per_layer():
    layout = KvGroupLayout.from_windows([0] * 30)
    assert layout.num_groups == 1
    assert layout.group_size == 30
    assert [layout.position_of(layer) for layer in range(30)] == list(range(30))
    # Same cost per block as one tensor per layer: 30 pages.
    assert layout.bytes_per_block(1000, range(30)) == 30_000
    assert layout.num_blocks(3_000_000, 1000, range(30)) == 100


def test_a_uniform_sliding_model_is_one_group_too():
    layout = KvGroupLayout.from_windows([4096] * 8)
    assert layout.windows == (4096,)
    assert layout.groups[0].is_sliding


def test_alternating_layers_make_one_group_per_kind():
    windows = [512 if layer % 2 == 0 else FULL_ATTENTION for layer in range(12)]
    layout = KvGroupLayout.from_windows(windows)
    assert layout.windows == (FULL_ATTENTION, 512)
    assert layout.group_size == 6
    assert layout.groups[0].layer_ids == (1, 3, 5, 7, 9, 11)
    assert layout.groups[1].layer_ids == (0, 2, 4, 6, 8, 10)
    # Layer 0 and layer 1 share tensor 0: half the tensors of one-per-layer.
    assert layout.position_of(0) == layout.position_of(1) == 0
    assert layout.bytes_per_block(1000, range(12)) == 6000


def test_a_five_to_one_model_cuts_the_larger_kind_into_groups_of_the_smaller():
    # Gemma-3 style: five sliding layers, then one full, six times.
    windows = [FULL_ATTENTION if layer % 6 == 5 else 1024 for layer in range(36)]
    layout = KvGroupLayout.from_windows(windows)
    assert layout.group_size == 6
    assert layout.windows == (FULL_ATTENTION,) + (1024,) * 5
    assert all(len(g.layer_ids) == 6 for g in layout.groups)
    every = sorted(itertools.chain.from_iterable(g.layer_ids for g in layout.groups))
    assert every == list(range(36))
    # Six tensors hold all 36 layers: each block id is one page in six tensors.
    assert layout.bytes_per_block(100, range(36)) == 600


def test_nearly_balanced_kinds_get_one_group_each_and_padding():
    # 9 full and 8 sliding layers: within 1.25x, so groups of 9 (the sliding one padded).
    windows = [FULL_ATTENTION] * 9 + [256] * 8
    layout = KvGroupLayout.from_windows(windows)
    assert layout.num_groups == 2
    assert layout.group_size == 9
    assert len(layout.groups[1].layer_ids) == 8


def test_unbalanced_kinds_leave_a_short_last_group():
    windows = [FULL_ATTENTION] * 4 + [256] * 10
    layout = KvGroupLayout.from_windows(windows)
    assert layout.group_size == 4
    assert [len(g.layer_ids) for g in layout.groups] == [4, 4, 4, 2]


def test_a_stage_that_splits_a_group_holds_only_its_positions():
    windows = [512 if layer % 2 == 0 else FULL_ATTENTION for layer in range(12)]
    layout = KvGroupLayout.from_windows(windows)
    first, second = range(0, 6), range(6, 12)     # pp=2 cuts both groups in the middle
    assert layout.positions(first) == (0, 1, 2)
    assert layout.positions(second) == (3, 4, 5)
    assert layout.num_blocks(6000, 1000, first) == 2
    # The replica's count is the smallest over ranks; a lopsided split costs more per block.
    lopsided = layout.positions(range(0, 7))
    assert lopsided == (0, 1, 2, 3)


def test_group_of_and_position_of_agree_with_the_groups():
    windows = [FULL_ATTENTION if layer % 3 == 0 else 64 for layer in range(9)]
    layout = KvGroupLayout.from_windows(windows)
    for index, group in enumerate(layout.groups):
        for position, layer in enumerate(group.layer_ids):
            assert layout.group_of(layer) == index
            assert layout.position_of(layer) == position
    with pytest.raises(KeyError):
        layout.group_of(9)


@pytest.mark.parametrize("windows", [[], [0, -1]])
def test_bad_windows_are_refused(windows):
    with pytest.raises(ValueError):
        KvGroupLayout.from_windows(windows)


def test_the_window_decides_which_tokens_stay_needed():
    assert first_needed_token(FULL_ATTENTION, 10_000) == 0
    assert first_needed_token(256, 100) == 0
    # The next query, at position 300, reads keys 45 .. 300.
    assert first_needed_token(256, 300) == 45
    assert first_needed_block(256, 300, 16) == 2


@pytest.mark.parametrize("window,block_size", [(256, 16), (255, 16), (17, 16), (16, 16),
                                               (5, 16), (100, 32)])
def test_the_bound_on_blocks_in_a_window_holds_and_is_reached(window, block_size):
    """Walk a request token by token: the blocks from its first needed one to the one its
    next token lands in never exceed the bound, and some position reaches it."""
    bound = max_blocks_in_window(window, block_size)
    most = 0
    for num_computed in range(4 * window + 3 * block_size):
        first = first_needed_block(window, num_computed, block_size)
        last = num_computed // block_size               # the block the new token goes in
        most = max(most, last - first + 1)
    assert most == bound
    if window == 256 and block_size == 16:
        assert bound == 256 // 16 + 1


def test_a_prefill_chunk_needs_the_window_behind_its_first_token():
    bound = max_blocks_in_window(64, 16, num_new_tokens=100)
    for num_computed in range(0, 500):
        first = first_needed_block(64, num_computed, 16)
        last = (num_computed + 99) // 16
        assert last - first + 1 <= bound


def test_describe_names_the_kinds():
    text = KvGroupLayout.from_windows([0, 128, 0, 128]).describe()
    assert "2 KV group(s)" in text and "window 128" in text and "full" in text
