"""Admission with partial chunks in the KV store (issue 24): a request whose chunks the store
holds to its very end, the last one partial (keyed by the hash of its exact tokens), loads
every token but its last; without that tail only whole chunks load. The prefix index commits
no block being loaded."""

import pytest

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from services.block_hash import hash_full_blocks
from services.kv_chunks import make_chunk, prefix_chunk_keys, prefix_hash
from services.kv_wire import (
    AdmitOp,
    AdmitResult,
    PlanRequest,
)
from tests.kvcache_svc.test_store_admission import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    SLICES,
    hit_miss,
    prompt,
)


def new_manager(store: KvStore | None = None) -> tuple[ReplicaBlockManager, KvStore]:
    """A replica with an empty cache over `store` (a new one unless given)."""
    if store is None:
        store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    return ReplicaBlockManager(129, BLOCK_SIZE, True, store=StoreView(store, SLICES,
                                                                      BLOCK_SIZE)), store


def store_prefix(store: KvStore, tokens: list[int], windows: list[int]) -> None:
    """Stores, for every slice, the chunks of `tokens` in `windows` (the last one ends at the
    end of `tokens`, partial when they end inside a window)."""
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    for kv_slice in SLICES:
        keys = prefix_chunk_keys(hashes, tokens, 0, len(tokens), BLOCK_SIZE, CHUNK_TOKENS,
                                 kv_slice)
        for window in windows:
            chunk = make_chunk(keys[window], (4,), bytes(8))
            assert store.put(chunk.header, chunk.data)


def admit(mgr: ReplicaBlockManager, request_id: str, tokens: list[int],
          with_tail: bool = True) -> AdmitResult:
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    tail = (prefix_hash(hashes, tokens, len(tokens), BLOCK_SIZE)
            if with_tail and len(tokens) % BLOCK_SIZE else None)
    op = AdmitOp(request_id, len(tokens), hashes, 4096, True, tail)
    reply = mgr.apply(PlanRequest(0, 1, [], [], [op]))
    assert reply.error is None and len(reply.admitted) == 1, reply
    return reply.admitted[0]


@pytest.mark.parametrize("num_tokens", [32, 30], ids=["full-blocks", "last-block-partial"])
def test_a_prompt_shorter_than_a_chunk_loads_all_but_its_last_token(num_tokens: int) -> None:
    mgr, store = new_manager()
    tokens = prompt(num_tokens)
    store_prefix(store, tokens, [0])
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_load_tokens, result.num_new_tokens) == (
        0, num_tokens - 1, 0)
    assert len(result.block_ids[0]) == 2                  # the last token's block included
    assert result.num_committed_blocks == 0               # loading: nothing indexed yet
    assert hit_miss(store) == (num_tokens, 0)


def test_a_partial_tail_needs_the_whole_chunks_before_it() -> None:
    mgr, store = new_manager()
    tokens = prompt(300)
    store_prefix(store, tokens, [1])                      # the tail [256, 300) only
    assert admit(mgr, "a", tokens).num_load_tokens == 0
    store_prefix(store, tokens, [0])
    assert admit(new_manager(store)[0], "b", tokens).num_load_tokens == 299


def test_without_its_tail_only_whole_chunks_load() -> None:
    mgr, store = new_manager()
    tokens = prompt(300)
    store_prefix(store, tokens, [0])
    result = admit(mgr, "a", tokens)
    assert (result.num_load_tokens, result.num_new_tokens) == (256, 0)
    assert hit_miss(store) == (256, 44)
    # Another prompt sharing only the first 290 tokens: its own tail is not the stored one.
    store_prefix(store, tokens, [1])
    other = tokens[:290] + prompt(5, seed=3)
    assert admit(new_manager(store)[0], "b", other).num_load_tokens == 256
    assert admit(new_manager(store)[0], "c", tokens).num_load_tokens == 299
    assert admit(new_manager(store)[0], "d", tokens, with_tail=False).num_load_tokens == 256


def test_a_device_hit_loads_only_the_tail_past_it() -> None:
    mgr, store = new_manager()
    tokens = prompt(300)
    admit(mgr, "warm", tokens[:CHUNK_TOKENS + 1])         # commits chunk 0's blocks
    store_prefix(store, tokens, [1])                      # the tail only: chunk 0 is cached
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_load_tokens) == (256, 43)
    assert len(result.block_ids[0]) == 19


def test_under_memory_pressure_the_whole_chunks_that_fit_are_loaded() -> None:
    """Blocks for 2 of the 3 held chunks: those 2 load now, chunked prefill computes the rest
    later; without chunked prefill (all or nothing) the request waits."""
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    tokens = prompt(800)
    store_prefix(store, tokens, [0, 1, 2, 3])
    mgr = ReplicaBlockManager(2 * 16 + 5 + 1, BLOCK_SIZE, True,
                              store=StoreView(store, SLICES, BLOCK_SIZE))   # 37 usable
    op = AdmitOp("a", 800, hash_full_blocks(tokens, BLOCK_SIZE), 4096, False, None)
    assert mgr.apply(PlanRequest(0, 1, [], [], [op])).admitted == []
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_load_tokens, result.num_new_tokens) == (
        0, 512, 0)
    assert len(result.block_ids[0]) == 32
    tight = ReplicaBlockManager(16 + 1, BLOCK_SIZE, True,
                                store=StoreView(store, SLICES, BLOCK_SIZE))   # 16 usable
    assert admit(tight, "b", tokens).num_load_tokens == 256
