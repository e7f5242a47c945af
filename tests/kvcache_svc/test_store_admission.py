"""Admission with loads from the KV store: ReplicaBlockManager over a StoreView of a real
in-memory KvStore, and KvCachePools configuring that view and answering prefix queries. No
network: chunks are put into the store directly, keyed as a worker would key them."""

import logging
from collections.abc import Iterable, Sequence

import pytest

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from kvcache_svc.pools import KvCachePools
from services.block_hash import hash_full_blocks
from services.codec import Codec
from services.kv_chunks import chunk_keys, make_chunk
from services.kv_store_wire import KvSlice
from services.kv_wire import (
    AdmitOp,
    AdmitResult,
    ConfigurePool,
    FromKvCache,
    GrowOp,
    KvAck,
    PlanReply,
    PlanRequest,
    PrefixQuery,
    PrefixReply,
    ReplicaPrefix,
)

BLOCK_SIZE = 16
CHUNK_TOKENS = 256
BLOCKS_PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE
# Two tensor-parallel ranks of a 3-KV-head model: each saves and loads its own slice.
SLICES = (KvSlice("tiny", "float16", 0, 2, 0, 2), KvSlice("tiny", "float16", 0, 2, 2, 3))


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    return [1000 * seed + 7 * i % 997 + 3 for i in range(num_tokens)]


def new_store() -> KvStore:
    return KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)


def put_chunks(store: KvStore, token_ids: list[int], indices: Iterable[int],
               slices: Sequence[KvSlice] = SLICES, block_size: int = BLOCK_SIZE) -> None:
    """Stores chunks `indices` of `token_ids` for each slice (tiny stand-in data)."""
    hashes = hash_full_blocks(token_ids, block_size)
    for kv_slice in slices:
        keys = chunk_keys(hashes, block_size, store.chunk_tokens, kv_slice)
        for index in indices:
            chunk = make_chunk(keys[index], (4,), bytes(range(index, index + 8)))
            assert store.put(chunk.header, chunk.data)


def manager(store: KvStore | None, num_blocks: int = 129,
            slices: Sequence[KvSlice] = SLICES) -> ReplicaBlockManager:
    view = None if store is None else StoreView(store, slices, BLOCK_SIZE)
    return ReplicaBlockManager(num_blocks, BLOCK_SIZE, True, store=view)


def admit_op(request_id: str, token_ids: list[int], max_new: int = 4096,
             allow_partial: bool = True) -> AdmitOp:
    return AdmitOp(request_id, len(token_ids), hash_full_blocks(token_ids, BLOCK_SIZE),
                   max_new, allow_partial)


def admit(mgr: ReplicaBlockManager, request_id: str, token_ids: list[int],
          **kw: object) -> AdmitResult:
    reply = mgr.apply(PlanRequest(0, 1, [], [], [admit_op(request_id, token_ids, **kw)]))
    assert reply.error is None and len(reply.admitted) == 1, reply
    return reply.admitted[0]


def hit_miss(store: KvStore) -> tuple[int, int]:
    stats = store.stats()
    return stats.num_hit_tokens, stats.num_miss_tokens


# --------------------------------------------------------------------------- block manager


def test_stored_chunks_are_loaded_not_computed() -> None:
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0, 1])
    mgr = manager(store)
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_new_tokens, result.num_load_tokens) == (
        0, 0, 512)
    assert len(result.block_ids[0]) == 512 // BLOCK_SIZE == len(set(result.block_ids[0]))
    assert result.num_committed_blocks == 0                  # no device hit: nothing indexed
    assert mgr.pool.num_cached_blocks == 0
    stats = mgr.stats()
    assert (stats.num_store_hits, stats.num_hits, stats.num_queries) == (512, 0, 600)
    assert stats.num_used_blocks == 32

    # The grow after the load computes the rest and commits the loaded blocks with its own.
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    reply = mgr.apply(PlanRequest(0, 2, [], [GrowOp("a", 600, hashes)], []))
    assert reply.error is None and reply.grown[0] is not None
    assert len(reply.grown[0][0]) == -(-600 // BLOCK_SIZE) - 32
    assert mgr.requests["a"].num_committed_blocks == len(hashes) == mgr.pool.num_cached_blocks
    assert mgr.num_cached_prefix_blocks(hashes) == len(hashes)


def test_a_device_hit_keeps_its_blocks_committed_and_loads_nothing_it_holds() -> None:
    store = new_store()
    tokens = prompt(600)
    mgr = manager(store)
    admit(mgr, "warm", tokens[:BLOCK_SIZE * 3 + 1])        # computes and commits 3 blocks
    put_chunks(store, tokens, [0, 1])
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_new_tokens, result.num_load_tokens) == (
        48, 0, 512 - 48)
    assert result.num_committed_blocks == 3                 # the device hits only
    assert result.block_ids[0][:3] == [b.block_id for b in mgr.requests["warm"].tables[0][:3]]
    assert len(result.block_ids[0]) == 32
    assert mgr.stats().num_store_hits == 512 - 48


@pytest.mark.parametrize("stored", [[0, 1], [1], [0]], ids=["both", "second-only", "first-only"])
def test_a_chunk_held_for_one_slice_only_is_not_loaded(stored: list[int]) -> None:
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0])                          # chunk 0: both ranks
    put_chunks(store, tokens, [1], slices=SLICES[:1])       # chunk 1: rank 0 only
    result = admit(manager(store), "a", tokens)
    assert (result.num_load_tokens, result.num_new_tokens) == (256, 0)
    assert len(result.block_ids[0]) == 16

    # No chunk for every slice: nothing loads, the request computes.
    other = new_store()
    put_chunks(other, tokens, stored, slices=SLICES[1:])
    result = admit(manager(other), "b", tokens)
    assert (result.num_load_tokens, result.num_new_tokens) == (0, 600)
    assert result.num_committed_blocks == 600 // BLOCK_SIZE


def test_a_chunk_after_a_missing_one_is_useless() -> None:
    store = new_store()
    tokens = prompt(800)
    put_chunks(store, tokens, [0, 2])
    result = admit(manager(store), "a", tokens)
    assert (result.num_load_tokens, result.num_new_tokens) == (256, 0)


def test_the_last_token_is_never_loaded() -> None:
    store = new_store()
    tokens = prompt(512)
    put_chunks(store, tokens, [0, 1])
    mgr = manager(store)
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_new_tokens, result.num_load_tokens) == (
        0, 0, 511)
    assert len(result.block_ids[0]) == 32
    assert mgr.stats().num_store_hits == 511


@pytest.mark.parametrize("stored", [[0, 1, 2], [1, 2]], ids=["chunks-0-2", "past-the-hit"])
def test_a_device_hit_of_a_chunk_loads_only_past_it(stored: list[int]) -> None:
    store = new_store()
    tokens = prompt(800)                                   # 3 whole chunks, 50 full blocks
    mgr = manager(store)
    admit(mgr, "warm", tokens[:CHUNK_TOKENS + 1])          # commits chunk 0's 16 blocks
    warm_blocks = [b.block_id for b in mgr.requests["warm"].tables[0][:BLOCKS_PER_CHUNK]]
    put_chunks(store, tokens, stored)
    before = hit_miss(store)
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_new_tokens, result.num_load_tokens) == (
        256, 0, 512)
    assert result.block_ids[0][:BLOCKS_PER_CHUNK] == warm_blocks
    assert len(result.block_ids[0]) == 768 // BLOCK_SIZE
    assert result.num_committed_blocks == BLOCKS_PER_CHUNK
    # Looked up from the hit's chunk on: chunks 1 and 2, both held, and the partial last
    # chunk [768, 800), not held (a miss), counted once.
    after = hit_miss(store)
    assert (after[0] - before[0], after[1] - before[1]) == (512, 32)


def test_a_device_hit_covering_what_the_store_holds_loads_nothing() -> None:
    store = new_store()
    tokens = prompt(600)
    mgr = manager(store)
    admit(mgr, "warm", tokens[:2 * CHUNK_TOKENS + 1])      # commits 32 blocks
    put_chunks(store, tokens, [0, 1])
    result = admit(mgr, "a", tokens)
    assert (result.num_cached_tokens, result.num_load_tokens, result.num_new_tokens) == (
        512, 0, 88)


def test_without_a_store_nothing_loads() -> None:
    tokens = prompt(600)
    for mgr in (manager(None), manager(new_store())):      # no view; a view of an empty store
        result = admit(mgr, "a", tokens)
        assert (result.num_load_tokens, result.num_new_tokens) == (0, 600)
        assert result.num_committed_blocks == 600 // BLOCK_SIZE
        assert mgr.stats().num_store_hits == 0
        assert mgr.num_stored_prefix_blocks(hash_full_blocks(tokens, BLOCK_SIZE)) == 0


def test_a_load_that_does_not_fit_admits_nothing_without_chunked_prefill() -> None:
    """(With chunked prefill the chunks that fit load: test_store_admission_partial.py.)"""
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0, 1])
    mgr = manager(store, num_blocks=31)                    # 30 usable blocks, 32 needed
    reply = mgr.apply(PlanRequest(0, 1, [], [], [admit_op("a", tokens, allow_partial=False)]))
    assert reply.error is None and reply.admitted == []
    assert mgr.stats().num_used_blocks == 0 and mgr.stats().num_store_hits == 0


def test_a_load_is_not_capped_by_the_token_budget() -> None:
    """The budget caps computed tokens; a load computes none (all or nothing either way)."""
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0, 1])
    result = admit(manager(store), "a", tokens, max_new=64, allow_partial=False)
    assert (result.num_load_tokens, result.num_new_tokens) == (512, 0)


def test_routing_queries_count_nothing_admissions_count_once() -> None:
    store = new_store()
    tokens = prompt(800)                                   # 3 whole chunks
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    put_chunks(store, tokens, [0, 1])
    mgr = manager(store)
    assert mgr.num_stored_prefix_blocks(hashes) == 2 * BLOCKS_PER_CHUNK
    assert mgr.num_stored_prefix_blocks(hashes[:BLOCKS_PER_CHUNK - 1]) == 0
    assert mgr.num_stored_prefix_blocks([]) == 0
    assert hit_miss(store) == (0, 0)
    assert store.stats().num_loaded_tokens == 0            # a lookup is not a load

    # A chunk held for one slice only does not count for the replica.
    put_chunks(store, tokens, [2], slices=SLICES[:1])
    assert mgr.num_stored_prefix_blocks(hashes) == 2 * BLOCKS_PER_CHUNK
    assert hit_miss(store) == (0, 0)

    admit(mgr, "a", tokens)
    # One admission: 2 chunks held, 1 and the partial last [768, 800) missed; not once per
    # slice (that would double them).
    assert hit_miss(store) == (512, 288)
    # Shorter than a chunk, its last block partial and no tail hash given: no lookup.
    admit(mgr, "short", prompt(CHUNK_TOKENS - 1, seed=5))
    assert hit_miss(store) == (512, 288)
    assert mgr.num_stored_prefix_blocks(hashes) == 2 * BLOCKS_PER_CHUNK
    assert hit_miss(store) == (512, 288)


def test_a_view_needs_whole_blocks_per_chunk_and_a_slice() -> None:
    with pytest.raises(ValueError, match="no multiple of the block size"):
        StoreView(new_store(), SLICES, 24)
    with pytest.raises(ValueError, match="at least one slice"):
        StoreView(new_store(), [], BLOCK_SIZE)


def test_a_refused_admission_counts_no_lookup() -> None:
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0, 1])
    mgr = manager(store, num_blocks=31)                    # 32 blocks needed: does not fit
    for plan_id in (1, 2, 3):                              # the scheduler retries each step
        reply = mgr.apply(PlanRequest(0, plan_id, [], [],
                                      [admit_op("a", tokens, allow_partial=False)]))
        assert reply.admitted == []
    assert hit_miss(store) == (0, 0)


# --------------------------------------------------------------------------- KvCachePools


def configure(pools: KvCachePools, replica_id: int, block_size: int = BLOCK_SIZE,
              slices: Sequence[KvSlice] = SLICES) -> None:
    ack = pools.handle(ConfigurePool(replica_id, 129, block_size, True,
                                     store_slices=list(slices)))
    assert ack == KvAck(None, pools.epoch)


def plan_admit(pools: KvCachePools, replica_id: int, token_ids: list[int],
               block_size: int = BLOCK_SIZE) -> AdmitResult:
    op = AdmitOp("a", len(token_ids), hash_full_blocks(token_ids, block_size), 4096, True)
    reply = pools.handle(PlanRequest(replica_id, 1, [], [], [op]))
    assert isinstance(reply, PlanReply) and reply.error is None, reply
    return reply.admitted[0]


def test_pools_configured_with_store_slices_load(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcache_svc.pools")
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0, 1])
    pools = KvCachePools(epoch=5)
    pools.store = store
    configure(pools, 0)
    assert "loads from the KV store on" in caplog.text
    result = plan_admit(pools, 0, tokens)
    assert (result.num_load_tokens, result.num_new_tokens) == (512, 0)
    assert pools.stats()[0][0].num_store_hits == 512

    configure(pools, 1, slices=())                         # no slices: no loads
    assert plan_admit(pools, 1, tokens).num_load_tokens == 0


def test_pools_without_a_store_never_load() -> None:
    tokens = prompt(600)
    pools = KvCachePools(epoch=5)                          # store None
    configure(pools, 0)
    assert plan_admit(pools, 0, tokens).num_load_tokens == 0
    reply = pools.handle(PrefixQuery(hash_full_blocks(tokens, BLOCK_SIZE)))
    assert reply == PrefixReply(5, [ReplicaPrefix(0, 600 // BLOCK_SIZE, 0)], None)


def test_a_chunk_size_that_is_no_multiple_of_the_block_size_means_no_view(
        caplog: pytest.LogCaptureFixture) -> None:
    store = new_store()
    tokens = prompt(600)
    put_chunks(store, tokens, [0, 1])
    pools = KvCachePools(epoch=5)
    pools.store = store
    with caplog.at_level(logging.WARNING, logger="kvcache_svc.pools"):
        configure(pools, 1, block_size=24)                 # 256 % 24 != 0: still configured
    assert "replica 1 will not load from the KV store" in caplog.text
    # A view would have failed to key the chunks (and the plan with it): no view, no loads.
    result = plan_admit(pools, 1, tokens, block_size=24)
    assert (result.num_load_tokens, result.num_new_tokens) == (0, 600)
    assert pools.stats()[0][1].num_blocks == 128
    reply = pools.handle(PrefixQuery(hash_full_blocks(tokens, 24)))
    assert isinstance(reply, PrefixReply)
    assert reply.replicas == [ReplicaPrefix(1, 600 // 24, 0)]   # computed, so indexed


def test_prefix_query_answers_stored_blocks_and_store_stats() -> None:
    store = new_store()
    tokens = prompt(800)
    hashes = hash_full_blocks(tokens, BLOCK_SIZE)
    put_chunks(store, tokens, [0, 1])
    pools = KvCachePools(epoch=5)
    pools.store = store
    configure(pools, 0)
    configure(pools, 2, slices=SLICES[1:])                 # another layout: rank 1's slice
    configure(pools, 3, slices=[KvSlice("other", "float16", 0, 2, 0, 3)])
    reply = pools.handle(PrefixQuery(hashes))
    assert isinstance(reply, PrefixReply)
    assert reply.replicas == [ReplicaPrefix(0, 0, 32), ReplicaPrefix(2, 0, 32),
                              ReplicaPrefix(3, 0, 0)]
    assert reply.store == store.stats()
    assert reply.store is not None and reply.store.chunk_tokens == CHUNK_TOKENS
    assert (reply.store.num_hit_tokens, reply.store.num_miss_tokens) == (0, 0)

    plan_admit(pools, 0, tokens)                           # loads 512, misses chunk 2
    again = pools.handle(PrefixQuery(hashes))
    assert isinstance(again, PrefixReply) and again.store is not None
    assert (again.store.num_hit_tokens, again.store.num_miss_tokens) == (512, 288)  # + tail
    assert again.replicas[0] == ReplicaPrefix(0, 0, 32)    # loaded blocks: not indexed yet

    # The reply crosses the wire with its store stats.
    codec = Codec(FromKvCache)
    assert codec.decode(codec.encode(again)) == again
