"""ReplicaBlockManager: the PlanRequest semantics of services/wire.py, the prefix query and the
KV events of each operation, driven directly."""

import random

import pytest

from kvcache_svc import block_manager
from kvcache_svc.block_manager import ReplicaBlockManager
from services.kv_wire import (
    AdmitOp,
    AdmitResult,
    BlockRemoved,
    BlockStored,
    CommitOp,
    GrowOp,
    PlanReply,
    PlanRequest,
)

BLOCK_SIZE = 4


def manager(num_blocks: int = 11, prefix_caching: bool = True,
            record_events: bool = False) -> ReplicaBlockManager:
    return ReplicaBlockManager(num_blocks, BLOCK_SIZE, prefix_caching,
                               record_events=record_events)


def plan(free_ids: list[str] | None = None, grows: list[GrowOp] | None = None,
         admits: list[AdmitOp] | None = None, plan_id: int = 1) -> PlanRequest:
    return PlanRequest(0, plan_id, free_ids or [], grows or [], admits or [])


def admit(request_id: str, num_tokens: int, block_hashes: list[int] | None = None,
          max_num_new_tokens: int = 1 << 20, allow_partial: bool = False) -> AdmitOp:
    return AdmitOp(request_id, num_tokens, block_hashes or [], max_num_new_tokens,
                   allow_partial)


def hashes(prefix: int, num_blocks: int) -> list[int]:
    """Stand-in chained hashes: equal prefixes give equal lists."""
    return [prefix * 1000 + i for i in range(num_blocks)]


def admit_one(mgr: ReplicaBlockManager, op: AdmitOp) -> AdmitResult:
    reply = mgr.apply(plan(admits=[op]))
    assert reply.error is None and len(reply.admitted) == 1, reply
    return reply.admitted[0]


def snapshot(mgr: ReplicaBlockManager) -> tuple:
    requests = {rid: ([b.block_id for b in s.tables[0]], s.num_committed_blocks)
                for rid, s in mgr.requests.items()}
    pool = mgr.pool
    index = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
    ref_cnts = [b.ref_cnt for b in pool.blocks]
    return requests, index, ref_cnts, pool.free_queue.block_ids(), mgr.stats()


def test_admit_without_hits_allocates_and_commits_full_blocks() -> None:
    mgr = manager()
    result = admit_one(mgr, admit("a", 10, hashes(1, 2)))
    assert result == AdmitResult("a", 0, 10, [[1, 2, 3]], 2)
    assert mgr.pool.num_cached_blocks == 2
    assert mgr.stats().num_free_blocks == 7 and mgr.stats().num_requests == 1


def test_admit_reuses_the_longest_cached_prefix() -> None:
    mgr = manager()
    first = admit_one(mgr, admit("a", 10, hashes(1, 2)))
    # Shares block 0 only: the second hash differs.
    result = admit_one(mgr, admit("b", 9, [hashes(1, 1)[0], 999]))
    assert result.num_cached_tokens == 4 and result.num_new_tokens == 5
    assert result.block_ids[0][0] == first.block_ids[0][0]
    assert result.num_committed_blocks == 2
    assert mgr.pool.blocks[first.block_ids[0][0]].ref_cnt == 2


def test_admit_hits_blocks_of_a_freed_request() -> None:
    mgr = manager()
    first = admit_one(mgr, admit("a", 10, hashes(1, 2)))
    mgr.apply(plan(free_ids=["a"]))
    result = admit_one(mgr, admit("b", 11, hashes(1, 2)))
    assert result.num_cached_tokens == 8 and result.num_new_tokens == 3
    assert result.block_ids[0][:2] == first.block_ids[0][:2]


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 8, hashes(1, 2)))
    result = admit_one(mgr, admit("b", 8, hashes(1, 2)))
    assert result.num_cached_tokens == 4 and result.num_new_tokens == 4
    assert len(result.block_ids[0]) == 2 and result.num_committed_blocks == 2
    # Its last block is its own (the cached twin keeps the hash).
    assert mgr.pool.blocks[result.block_ids[0][1]].block_hash is None
    assert mgr.stats().num_hits == 4


def test_partial_admission_is_capped_by_the_budget() -> None:
    mgr = manager()
    result = admit_one(mgr, admit("a", 20, hashes(1, 5), max_num_new_tokens=6,
                                  allow_partial=True))
    assert result.num_new_tokens == 6 and result.num_cached_tokens == 0
    assert len(result.block_ids[0]) == 2             # ceil(6 / 4)
    assert result.num_committed_blocks == 1       # only block 0 is full


def test_whole_admission_over_budget_fails_and_stops_the_queue() -> None:
    mgr = manager()
    reply = mgr.apply(plan(admits=[admit("a", 5), admit("b", 20, max_num_new_tokens=6),
                                   admit("c", 1)]))
    assert reply.error is None
    assert [r.request_id for r in reply.admitted] == ["a"]
    assert set(mgr.requests) == {"a"}


def test_admission_stops_at_the_first_that_does_not_fit() -> None:
    mgr = manager(num_blocks=5)                   # 4 usable blocks
    reply = mgr.apply(plan(admits=[admit("a", 8), admit("b", 12), admit("c", 4)]))
    assert [r.request_id for r in reply.admitted] == ["a"]   # c would fit, but FCFS
    assert reply.num_free_blocks == 2


def test_evictable_hits_do_not_count_as_room_twice() -> None:
    mgr = manager(num_blocks=4)                   # 3 usable blocks
    admit_one(mgr, admit("a", 8, hashes(1, 2)))
    mgr.apply(plan(free_ids=["a"]))
    assert mgr.pool.num_free_blocks == 3
    # 1 hit (evictable) + 2 new blocks needed: only 2 free blocks remain once the hit is
    # touched, so it fits exactly; one more token needs a 4th block and does not.
    assert mgr.apply(plan(admits=[admit("b", 13, hashes(1, 3))])).admitted == []
    assert admit_one(mgr, admit("b", 12, hashes(1, 2))).num_cached_tokens == 8
    assert mgr.pool.num_free_blocks == 0


def test_grow_allocates_to_cover_num_tokens_and_commits_hashes() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 3))
    reply = mgr.apply(plan(grows=[GrowOp("a", 4, [77])]))
    assert reply.grown == [[[]]]                    # block 0 just became full
    assert mgr.pool.get_cached_block(77) is mgr.requests["a"].tables[0][0]
    reply = mgr.apply(plan(grows=[GrowOp("a", 9, [78])]))
    assert reply.grown == [[[2, 3]]]
    assert mgr.requests["a"].num_committed_blocks == 2
    assert mgr.pool.get_cached_block(78).block_id == 2


def test_a_grow_that_does_not_fit_fails_alone() -> None:
    mgr = manager(num_blocks=5)                   # 4 usable blocks
    admit_one(mgr, admit("a", 4))
    admit_one(mgr, admit("b", 4))
    reply = mgr.apply(plan(grows=[GrowOp("a", 16, [1]), GrowOp("b", 8, [2])]))
    assert reply.grown == [None, [[3]]]
    assert len(mgr.requests["a"].tables[0]) == 1
    assert mgr.requests["a"].num_committed_blocks == 0   # nothing committed on failure
    assert mgr.pool.get_cached_block(1) is None
    assert mgr.pool.get_cached_block(2) is not None


def test_frees_run_before_grows_and_release_in_reverse() -> None:
    mgr = manager(num_blocks=5)
    admit_one(mgr, admit("a", 8, hashes(1, 2)))
    admit_one(mgr, admit("b", 8))
    reply = mgr.apply(plan(free_ids=["a"], grows=[GrowOp("b", 12, [])]))
    assert reply.grown == [[[2]]]                   # a's tail block, evicted first
    assert mgr.pool.get_cached_block(hashes(1, 2)[0]).block_id == 1
    assert mgr.pool.get_cached_block(hashes(1, 2)[1]) is None


def test_free_then_admit_of_the_same_id_in_one_plan() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 6, hashes(1, 1)))
    reply = mgr.apply(plan(free_ids=["a"], admits=[admit("a", 6, hashes(1, 1))]))
    assert reply.error is None and reply.admitted[0].num_cached_tokens == 4


def test_invalid_plans_are_refused_without_any_change() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 6, hashes(1, 1)))
    admit_one(mgr, admit("b", 3))
    before = snapshot(mgr)
    bad_plans = [
        plan(free_ids=["nope"]),
        plan(free_ids=["a", "a"]),
        plan(free_ids=["b"], grows=[GrowOp("nope", 4, [])]),
        plan(free_ids=["a"], grows=[GrowOp("a", 8, [])]),           # grown after free
        plan(grows=[GrowOp("b", 4, []), GrowOp("b", 8, [])]),
        plan(grows=[GrowOp("a", 7, [5])]),                           # block 1 not full
        plan(admits=[admit("c", 4), admit("c", 4)]),
        plan(free_ids=["b"], admits=[admit("a", 4)]),                 # a still holds blocks
        plan(grows=[GrowOp("b", 4, [])], admits=[admit("b", 4)]),
        plan(admits=[admit("c", 0)]),
        plan(admits=[admit("c", 7, hashes(2, 2))]),                  # 2 hashes, 1 full block
        plan(admits=[admit("c", 1 << 39)]),                          # over the block limit
    ]
    for bad in bad_plans:
        reply = mgr.apply(bad)
        assert reply.error, bad
        assert reply.grown == [] and reply.admitted == []
        assert snapshot(mgr) == before, bad


def test_hit_rate_counts_tokens_of_admitted_requests() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 10, hashes(1, 2)))
    admit_one(mgr, admit("b", 10, hashes(1, 2)))
    mgr.apply(plan(admits=[admit("c", 100, max_num_new_tokens=5)]))  # refused: not counted
    stats = mgr.stats()
    assert (stats.num_queries, stats.num_hits) == (20, 8)
    assert stats.hit_rate == 0.4


def test_prefix_caching_off_never_hits_or_indexes() -> None:
    mgr = manager(prefix_caching=False)
    admit_one(mgr, admit("a", 10, hashes(1, 2)))
    mgr.apply(plan(grows=[GrowOp("a", 12, [5])]))
    result = admit_one(mgr, admit("b", 10, hashes(1, 2)))
    assert result.num_cached_tokens == 0 and result.num_committed_blocks == 0
    assert mgr.pool.num_cached_blocks == 0 and mgr.stats().num_queries == 0


def test_clear_drops_cached_free_blocks() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 10, hashes(1, 2)))
    admit_one(mgr, admit("b", 10, hashes(2, 2)))
    mgr.apply(plan(free_ids=["a"]))
    assert mgr.clear() == 2
    assert mgr.stats().num_cached_blocks == 2     # b's blocks are in use
    assert admit_one(mgr, admit("c", 10, hashes(1, 2))).num_cached_tokens == 0


def test_replies_carry_the_epoch() -> None:
    mgr = ReplicaBlockManager(5, BLOCK_SIZE, True, epoch=1234)
    assert mgr.apply(plan(admits=[admit("a", 4)])).epoch == 1234
    assert mgr.apply(plan(free_ids=["nope"])).epoch == 1234          # refused


def test_prefix_query_counts_leading_hits_and_changes_nothing() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 13, hashes(1, 3)))
    mgr.apply(plan(free_ids=["a"]))               # all three evictable
    before = snapshot(mgr)
    assert mgr.num_cached_prefix_blocks(hashes(1, 3)) == 3
    # No num_tokens - 1 cap here: the whole prompt may be cached.
    assert mgr.num_cached_prefix_blocks(hashes(1, 2)) == 2
    assert mgr.num_cached_prefix_blocks([*hashes(1, 1), 999, hashes(1, 3)[2]]) == 1
    assert mgr.num_cached_prefix_blocks(hashes(2, 3)) == 0
    assert snapshot(mgr) == before


def test_plan_events_report_stored_then_evicted_hashes() -> None:
    mgr = manager(num_blocks=4, record_events=True)  # 3 usable blocks
    assert mgr.drain_events() == []
    admit_one(mgr, admit("a", 9, hashes(1, 2)))
    assert mgr.drain_events() == [BlockStored(hashes(1, 2))]
    mgr.apply(plan(grows=[GrowOp("a", 12, [hashes(1, 3)[2]])]))
    assert mgr.drain_events() == [BlockStored([hashes(1, 3)[2]])]
    # Freed tail first: admitting b takes a's last block, then its middle one.
    reply = mgr.apply(plan(free_ids=["a"], admits=[admit("b", 8, hashes(2, 2))]))
    assert reply.admitted[0].num_cached_tokens == 0
    assert mgr.drain_events() == [BlockRemoved([hashes(1, 3)[2], hashes(1, 3)[1]]),
                                  BlockStored(hashes(2, 2))]
    assert mgr.apply(plan(free_ids=["nope"])).error     # refused: changes nothing
    assert mgr.drain_events() == []


def test_a_hash_evicted_and_stored_again_in_one_plan_keeps_its_order() -> None:
    mgr = manager(num_blocks=3, record_events=True)  # 2 usable blocks
    admit_one(mgr, admit("a", 5, hashes(1, 1)))
    mgr.apply(plan(free_ids=["a"]))
    mgr.drain_events()
    # c takes the free block without a hash. d cannot hit its only full block (one token must
    # be computed), so it takes the last free block, a's: 1000 leaves the index and comes back.
    reply = mgr.apply(plan(admits=[admit("c", 1), admit("d", 4, hashes(1, 1))]))
    assert [r.request_id for r in reply.admitted] == ["c", "d"]
    assert mgr.drain_events() == [BlockRemoved(hashes(1, 1)), BlockStored(hashes(1, 1))]


def test_long_event_runs_are_split_at_the_wire_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = manager(record_events=True)
    admit_one(mgr, admit("a", 20, hashes(1, 5)))
    monkeypatch.setattr(block_manager, "MAX_BLOCKS_PER_REQUEST", 2)
    assert mgr.drain_events() == [BlockStored(hashes(1, 5)[:2]), BlockStored(hashes(1, 5)[2:4]),
                                  BlockStored(hashes(1, 5)[4:])]


def test_clear_events_name_the_dropped_hashes() -> None:
    mgr = manager(record_events=True)
    admit_one(mgr, admit("a", 10, hashes(1, 2)))
    admit_one(mgr, admit("b", 6, hashes(2, 1)))
    mgr.apply(plan(free_ids=["a"]))
    mgr.drain_events()
    assert mgr.clear() == 2
    assert mgr.drain_events() == [BlockRemoved(hashes(1, 2))]


def test_random_plans_keep_the_pool_consistent() -> None:
    rng = random.Random(0)
    mgr = manager(num_blocks=40)
    num_covered: dict[str, int] = {}              # tokens each request's blocks hold
    for plan_id in range(400):
        held = list(mgr.requests)
        freed = rng.sample(held, k=min(len(held), rng.randint(0, 2)))
        grows = []
        for rid in held:
            if rid not in freed and rng.random() < 0.7:
                num_tokens = num_covered[rid] + rng.randint(0, 6)
                num_full = num_tokens // BLOCK_SIZE - mgr.requests[rid].num_committed_blocks
                grows.append(GrowOp(rid, num_tokens,
                                    [rng.randint(0, 30) for _ in range(num_full)]))
        admits = []
        for i in range(rng.randint(0, 3)):
            num_tokens = rng.randint(1, 30)
            admits.append(admit(f"r{plan_id}.{i}", num_tokens,
                                hashes(rng.randint(0, 3), num_tokens // BLOCK_SIZE),
                                max_num_new_tokens=rng.randint(1, 24),
                                allow_partial=rng.random() < 0.5))
        reply: PlanReply = mgr.apply(plan(freed, grows, admits, plan_id))
        assert reply.error is None
        for op, new_block_ids in zip(grows, reply.grown, strict=True):
            if new_block_ids is not None:
                num_covered[op.request_id] = op.num_tokens
        for result in reply.admitted:
            num_covered[result.request_id] = result.num_cached_tokens + result.num_new_tokens
        assert reply.num_free_blocks == mgr.pool.num_free_blocks
        check_invariants(mgr)


def check_invariants(mgr: ReplicaBlockManager) -> None:
    pool = mgr.pool
    ref_cnts = [0] * len(pool.blocks)
    for state in mgr.requests.values():
        block_ids = [b.block_id for b in state.tables[0]]
        assert 0 not in block_ids and len(set(block_ids)) == len(block_ids)
        for block_id in block_ids:
            ref_cnts[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == ref_cnts
    free_ids = pool.free_queue.block_ids()
    assert sorted(free_ids) == [i for i, n in enumerate(ref_cnts) if n == 0 and i != 0]
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.get_cached_block(block.block_hash) is block
    assert pool.num_cached_blocks == sum(b.block_hash is not None for b in pool.blocks)


def test_commits_come_before_frees_and_keep_the_blocks_cached() -> None:
    # A request freed with full blocks no grow committed (the scheduler grew it ahead and
    # planned nothing since): the plan commits them first, so they stay cached once freed.
    mgr = manager()
    admit_one(mgr, admit("a", 8))                   # two blocks, nothing committed
    reply = mgr.apply(PlanRequest(0, 2, ["a"], [], [], [CommitOp("a", [55, 56])]))
    assert reply.error is None and "a" not in mgr.requests
    assert mgr.pool.get_cached_block(55) is not None
    assert mgr.pool.get_cached_block(56) is not None
    result = admit_one(mgr, admit("b", 9, [55, 56]))
    assert result.num_cached_tokens == 8


def test_a_commit_of_an_unknown_request_or_past_its_blocks_is_refused() -> None:
    mgr = manager()
    admit_one(mgr, admit("a", 8))
    before = snapshot(mgr)
    for commit, why in [(CommitOp("x", [1]), "unknown request"),
                        (CommitOp("a", [1, 2, 3]), "more hashes")]:
        reply = mgr.apply(PlanRequest(0, 3, [], [], [], [commit]))
        assert reply.error is not None and why in reply.error
        assert snapshot(mgr) == before
