"""KvCachePools (kvcache_svc/pools.py) driven directly, no network: the instance epoch in
every reply, pool (re)configuration, the prefix query, one event batch per operation."""

import time

import msgspec
import pytest

from kvcache_svc import pools as pools_module
from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.pools import KvCachePools
from services.block_hash import hash_full_blocks
from services.codec import Codec, DecodeError
from services.kv_wire import (
    AdmitOp,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConfigurePool,
    DropPool,
    FromKvCache,
    GrowOp,
    KvAck,
    KvEventBatch,
    PlanReply,
    PlanRequest,
    PrefixQuery,
    PrefixReply,
    ReplicaPrefix,
)

BLOCK_SIZE = 4


def admit_plan(replica_id: int, plan_id: int, request_id: str,
               token_ids: list[int]) -> PlanRequest:
    op = AdmitOp(request_id, len(token_ids), hash_full_blocks(token_ids, BLOCK_SIZE),
                 max_num_new_tokens=1024, allow_partial=False)
    return PlanRequest(replica_id, plan_id, [], [], [op])


def test_the_epoch_defaults_to_the_start_time_and_is_bounded() -> None:
    before = time.time_ns()
    assert before <= KvCachePools().epoch <= time.time_ns()
    assert KvCachePools(epoch=0).epoch == 0
    for bad in (-1, 1 << 63):
        with pytest.raises(ValueError):
            KvCachePools(epoch=bad)


def test_every_reply_of_the_pools_carries_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    pools = KvCachePools(epoch=42)
    replies = [
        pools.handle(ConfigurePool(0, 8, BLOCK_SIZE, True)),
        pools.handle(ConfigurePool(1, 1 << 30, BLOCK_SIZE, True)),   # refused: too large
        pools.handle(admit_plan(0, 1, "a", [1, 2, 3])),
        pools.handle(PlanRequest(0, 2, ["nope"], [], [])),            # refused plan
        pools.handle(admit_plan(3, 3, "a", [1])),                     # unknown replica
        pools.handle(PrefixQuery([1, 2])),
        pools.handle(DropPool(0)),
        pools.handle(DropPool(0)),                                    # already gone
    ]
    def broken(self: KvCachePools, query: PrefixQuery) -> PrefixReply:
        raise RuntimeError("boom")

    monkeypatch.setattr(KvCachePools, "_query", broken)
    replies.append(pools.handle(PrefixQuery([])))                     # internal error
    assert [r.error is not None for r in replies if not isinstance(r, PrefixReply)] == [
        False, True, False, True, True, False, False, True]
    assert {reply.epoch for reply in replies} == {42}


def test_a_plan_for_a_missing_pool_is_an_error() -> None:
    pools = KvCachePools()
    pools.handle(ConfigurePool(1, 8, BLOCK_SIZE, True))
    pools.handle(DropPool(1))
    for replica_id in (0, 1):                     # never configured; dropped
        reply = pools.handle(admit_plan(replica_id, 9, "a", [1, 2]))
        assert isinstance(reply, PlanReply) and reply.plan_id == 9
        assert reply.error == (f"unknown replica {replica_id}: its pool is not configured "
                               f"(or was dropped)")


def test_configure_over_an_existing_pool_starts_afresh() -> None:
    batches: list[KvEventBatch] = []
    pools = KvCachePools(epoch=1, publish=batches.append)
    pools.handle(ConfigurePool(0, 8, BLOCK_SIZE, True))
    prompt = list(range(13))
    pools.handle(admit_plan(0, 1, "a", prompt))
    assert pools.handle(PrefixQuery(hash_full_blocks(prompt, BLOCK_SIZE))) == PrefixReply(
        1, [ReplicaPrefix(0, 3)])

    assert pools.handle(ConfigurePool(0, 16, BLOCK_SIZE, True)) == KvAck(None, 1)
    stats = pools.stats()[0][0]
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_cached_blocks,
            stats.num_requests, stats.num_queries) == (15, 0, 0, 0, 0)
    assert pools.handle(PrefixQuery(hash_full_blocks(prompt, BLOCK_SIZE))) == PrefixReply(
        1, [ReplicaPrefix(0, 0)])
    grow = pools.handle(PlanRequest(0, 2, [], [GrowOp("a", 14, [])], []))
    assert isinstance(grow, PlanReply) and "unknown" in (grow.error or "")    # a is gone
    again = pools.handle(admit_plan(0, 3, "a", prompt))
    assert isinstance(again, PlanReply) and again.admitted[0].num_cached_tokens == 0
    assert batches[1] == KvEventBatch(1, 1, 0, [AllBlocksCleared()])


def test_prefix_query_counts_per_replica_and_changes_nothing() -> None:
    pools = KvCachePools()
    pools.handle(ConfigurePool(1, 8, BLOCK_SIZE, True))
    pools.handle(ConfigurePool(0, 8, BLOCK_SIZE, True))
    prompt = list(range(13))                      # 3 full blocks
    hashes = hash_full_blocks(prompt, BLOCK_SIZE)
    pools.handle(admit_plan(0, 1, "a", prompt))
    pools.handle(admit_plan(0, 2, "b", list(range(50, 55))))
    pools.handle(PlanRequest(0, 3, ["a"], [], []))           # a's blocks: evictable
    manager = pools._managers[0]
    free_order = manager.pool.free_queue.block_ids()
    before = pools.stats()

    def query(block_hashes: list[int]) -> list[ReplicaPrefix]:
        reply = pools.handle(PrefixQuery(block_hashes))
        assert isinstance(reply, PrefixReply) and reply.epoch == pools.epoch
        return reply.replicas

    assert query(hashes) == [ReplicaPrefix(0, 3), ReplicaPrefix(1, 0)]
    assert query(hashes[:2] + [12345] + hashes[3:]) == [ReplicaPrefix(0, 2), ReplicaPrefix(1, 0)]
    assert query([12345, *hashes]) == [ReplicaPrefix(0, 0), ReplicaPrefix(1, 0)]
    assert query([]) == [ReplicaPrefix(0, 0), ReplicaPrefix(1, 0)]
    assert pools.stats() == before
    assert manager.pool.free_queue.block_ids() == free_order   # no LRU touch
    assert KvCachePools(epoch=9).handle(PrefixQuery(hashes)) == PrefixReply(9, [])


def test_the_number_of_pools_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools_module, "MAX_REPLICAS", 2)
    pools = KvCachePools(epoch=3)
    assert pools.handle(ConfigurePool(0, 4, BLOCK_SIZE, True)) == KvAck(None, 3)
    assert pools.handle(ConfigurePool(1, 4, BLOCK_SIZE, True)) == KvAck(None, 3)
    refused = pools.handle(ConfigurePool(2, 4, BLOCK_SIZE, True))
    assert isinstance(refused, KvAck) and "already 2 pools" in (refused.error or "")
    assert pools.handle(ConfigurePool(1, 8, BLOCK_SIZE, True)) == KvAck(None, 3)  # re-create


def test_one_event_batch_per_operation_that_changes_an_index() -> None:
    batches: list[KvEventBatch] = []
    pools = KvCachePools(epoch=5, publish=batches.append)
    pools.handle(ConfigurePool(0, 8, BLOCK_SIZE, True))
    pools.handle(ConfigurePool(1, 8, BLOCK_SIZE, True))
    pools.handle(ConfigurePool(2, 8, BLOCK_SIZE, False))
    first, second = list(range(9)), list(range(20, 29))
    pools.handle(admit_plan(0, 1, "a", first))
    pools.handle(admit_plan(0, 2, "b", second))
    pools.handle(admit_plan(1, 3, "a", first))
    pools.handle(admit_plan(2, 4, "a", first))               # prefix caching off: no event
    pools.handle(PlanRequest(0, 5, ["nope"], [], []))        # refused: no event
    pools.handle(PrefixQuery(hash_full_blocks(first, BLOCK_SIZE)))
    pools.handle(PlanRequest(0, 6, ["a"], [], []))           # a free: no event yet
    assert pools.clear(0) == 2                    # b still holds its blocks
    pools.handle(PlanRequest(1, 7, ["a"], [], []))
    assert pools.clear(None) == 2                 # replica 1 emptied, replica 0 had nothing
    pools.handle(DropPool(0))
    pools.handle(DropPool(0))                     # unknown by now: no event
    pools.handle(DropPool(2))                     # its index was empty, but it is gone

    hashes = {name: hash_full_blocks(tokens, BLOCK_SIZE)
              for name, tokens in (("first", first), ("second", second))}
    expected = [
        (0, [BlockStored(hashes["first"])]),
        (0, [BlockStored(hashes["second"])]),
        (1, [BlockStored(hashes["first"])]),
        (0, [BlockRemoved(hashes["first"])]),
        (1, [AllBlocksCleared()]),
        (0, [AllBlocksCleared()]),
        (2, [AllBlocksCleared()]),
    ]
    assert [(b.replica_id, b.events) for b in batches] == expected
    assert [b.seq for b in batches] == list(range(len(expected)))
    assert {b.epoch for b in batches} == {5}
    codec = Codec(KvEventBatch)
    assert [codec.decode(codec.encode(b)) for b in batches] == batches


def test_wire_bounds_of_the_new_fields() -> None:
    codec = Codec(FromKvCache)
    top = (1 << 63) - 1
    assert codec.decode(codec.encode(KvAck(None, top))) == KvAck(None, top)
    with pytest.raises(DecodeError):
        codec.decode(codec.encode(KvAck(None, 1 << 63)))
    with pytest.raises(DecodeError):
        codec.decode(codec.encode(KvAck(None, -1)))
    with pytest.raises(DecodeError):                          # epoch missing
        codec.decode(msgspec.msgpack.encode(["KvAck", None]))


def test_a_failure_inside_a_plan_becomes_an_error_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pools = KvCachePools()
    assert pools.handle(ConfigurePool(0, 8, BLOCK_SIZE, True)) == KvAck(None, pools.epoch)

    def broken(self: ReplicaBlockManager, plan: PlanRequest) -> PlanReply:
        raise RuntimeError("boom")

    monkeypatch.setattr(ReplicaBlockManager, "apply", broken)
    reply = pools.handle(admit_plan(0, 5, "a", [1, 2, 3]))
    assert isinstance(reply, PlanReply) and reply.plan_id == 5
    assert "boom" in (reply.error or "")
    monkeypatch.undo()
    reply = pools.handle(admit_plan(0, 6, "a", [1, 2, 3]))
    assert isinstance(reply, PlanReply) and reply.error is None


def test_a_newer_scheduler_drops_the_previous_ones_pools_and_an_older_one_is_refused() -> None:
    batches: list[KvEventBatch] = []
    pools = KvCachePools(epoch=1, publish=batches.append)
    for replica_id in (0, 1):
        ack = pools.handle(ConfigurePool(replica_id, 16, BLOCK_SIZE, True, scheduler_epoch=10))
        assert ack == KvAck(None, 1)
    # The scheduler restarted (epoch 20) and configures only replica 0 so far: replica 1 of
    # the old instance is gone with it.
    assert pools.handle(ConfigurePool(0, 16, BLOCK_SIZE, True, scheduler_epoch=20)).error is None
    reply = pools.handle(PrefixQuery([]))
    assert isinstance(reply, PrefixReply) and [r.replica_id for r in reply.replicas] == [0]
    assert [(b.replica_id, b.events) for b in batches] == [(0, [AllBlocksCleared()]),
                                                           (1, [AllBlocksCleared()])]
    stale = pools.handle(ConfigurePool(1, 16, BLOCK_SIZE, True, scheduler_epoch=10))
    assert isinstance(stale, KvAck) and "older" in (stale.error or "")


def test_a_pool_is_configured_with_its_groups_and_told_what_to_keep_for_the_store() -> None:
    from kvcache_svc.kv_store.memory_tier import MemoryTier
    from kvcache_svc.kv_store.store import KvStore

    pools = KvCachePools(epoch=1)
    ack = pools.handle(ConfigurePool(0, 32, BLOCK_SIZE, True, group_windows=[0, 8]))
    assert isinstance(ack, KvAck) and ack.error is None and ack.save_chunk_tokens == 0
    reply = pools.handle(admit_plan(0, 1, "a", list(range(10))))
    assert isinstance(reply, PlanReply) and len(reply.admitted[0].block_ids) == 2
    # With a store, a sliding group keeps the chunk in progress; a model without one does
    # not need to.
    pools.store = KvStore([MemoryTier(1 << 20)], chunk_tokens=16)
    ack = pools.handle(ConfigurePool(1, 32, BLOCK_SIZE, True, group_windows=[0, 8]))
    assert isinstance(ack, KvAck) and ack.save_chunk_tokens == 16
    assert pools.handle(ConfigurePool(2, 32, BLOCK_SIZE, True)).save_chunk_tokens == 0
    # Windows kvcache_svc cannot use are refused, not half-applied.
    bad = pools.handle(ConfigurePool(3, 32, BLOCK_SIZE, True, group_windows=[-1]))
    assert isinstance(bad, KvAck) and bad.error is not None
    assert pools.handle(PrefixQuery([])).replicas[-1].replica_id == 2
