"""`scatter_tokens`, the loader's copy of a chunk's tokens into a request's blocks, checked
against a plain per-token copy for every kind of range (aligned or not at each end, within one
block, across many), for layers in two KV groups with their own blocks, leaving every other
slot untouched. (Copying whole blocks as blocks was tried: no faster in the service here.)"""

import pytest
import torch

from services.kv_chunks import make_chunk
from services.kv_store_wire import KvSlice
from worker_svc.kv_loader import scatter_tokens

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 3, 2, 4, 4, 24
GROUPS = [0, 1, 0]                       # layer 1 in its own KV group, with other blocks
BLOCK_IDS = [[5, 2, 9, 11, 3, 17, 8], [20, 1, 14, 6, 22, 13, 7]]


def chunk_of(num_tokens: int):  # type: ignore[no-untyped-def]
    data = torch.randn(LAYERS, 2, num_tokens, HEADS, DIM)
    key = KvSlice("m@0", "float32", 0, LAYERS, 0, HEADS).key(b"\x01" * 32, num_tokens)
    chunk = make_chunk(key, tuple(data.shape), data.numpy().tobytes())
    return chunk, data


@pytest.mark.parametrize("first,position,num_tokens", [
    (0, 0, 16),         # whole blocks only
    (0, 4, 13),         # whole blocks, then a partial one
    (3, 6, 10),         # partial, whole, partial
    (1, 9, 2),          # inside one block
    (0, 8, 4),          # exactly one block
    (5, 1, 3),          # the end of the first block
    (0, 0, 27),         # many blocks and a tail
])
def test_scatter_matches_a_per_token_copy(first: int, position: int, num_tokens: int) -> None:
    torch.manual_seed(first * 100 + position)
    chunk, data = chunk_of(first + num_tokens + 2)
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    expected = [c.clone() for c in caches]
    for layer in range(LAYERS):
        ids = BLOCK_IDS[GROUPS[layer]]
        for t in range(num_tokens):
            p = position + t
            expected[layer][:, ids[p // BLOCK], p % BLOCK] = data[layer, :, first + t]
    scatter_tokens(caches, chunk, BLOCK_IDS, first, position, num_tokens, GROUPS)
    for layer in range(LAYERS):
        assert torch.equal(caches[layer], expected[layer]), f"layer {layer}"


def test_nothing_to_copy_changes_nothing() -> None:
    chunk, _ = chunk_of(4)
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM) for _ in range(LAYERS)]
    before = [c.clone() for c in caches]
    scatter_tokens(caches, chunk, BLOCK_IDS, 0, 3, 0, GROUPS)
    assert all(torch.equal(a, b) for a, b in zip(caches, before))
