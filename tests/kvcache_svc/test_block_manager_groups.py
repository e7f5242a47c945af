"""ReplicaBlockManager with KV groups: sliding groups give back what their window left (the
null block stays in the table), a long request's memory is bounded by its window, prefix hits
are per group, and frees return every group's blocks."""

import random

import pytest

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.block_pool import NULL_BLOCK_ID
from services.kv_groups import first_kept_block, max_blocks_in_window
from services.kv_wire import (
    AdmitOp,
    BlockStored,
    GrowOp,
    PlanRequest,
)

BLOCK_SIZE = 4
WINDOW = 8                   # a query reads itself and the 7 tokens before it


def manager(num_blocks: int = 64, windows: tuple[int, ...] = (0, WINDOW),
            block_size: int = BLOCK_SIZE, **kwargs) -> ReplicaBlockManager:  # type: ignore[no-untyped-def]
    return ReplicaBlockManager(num_blocks, block_size, True, group_windows=windows, **kwargs)


def hashes(prefix: int, num_blocks: int) -> list[int]:
    return [prefix * 1000 + i for i in range(num_blocks)]


def admit(mgr: ReplicaBlockManager, request_id: str, num_tokens: int, block_hashes: list[int],
          max_new: int = 1 << 20):  # type: ignore[no-untyped-def]
    reply = mgr.apply(PlanRequest(0, 1, [], [], [AdmitOp(request_id, num_tokens, block_hashes,
                                                         max_new, True)]))
    assert reply.error is None and len(reply.admitted) == 1, reply
    return reply.admitted[0]


def grow(mgr: ReplicaBlockManager, request_id: str, num_computed: int, num_tokens: int,
         block_hashes: list[int] | None = None) -> list[list[int]] | None:
    reply = mgr.apply(PlanRequest(0, 1, [], [GrowOp(request_id, num_tokens, block_hashes or [],
                                                    num_computed)], []))
    assert reply.error is None, reply
    return reply.grown[0]


def table_ids(mgr: ReplicaBlockManager, request_id: str, group: int) -> list[int]:
    return mgr.requests[request_id].block_ids()[group]


def held(mgr: ReplicaBlockManager, request_id: str, group: int) -> int:
    return sum(1 for b in table_ids(mgr, request_id, group) if b != NULL_BLOCK_ID)


def test_a_sliding_group_frees_what_its_window_left_and_keeps_the_null_block() -> None:
    mgr = manager()
    result = admit(mgr, "a", 10, [])
    assert [len(ids) for ids in result.block_ids] == [3, 3]
    assert not set(result.block_ids[0]) & set(result.block_ids[1])   # one group per block
    # The step from 10: its first query (position 10) reads 3..10, block 0 included.
    grow(mgr, "a", 10, 12)
    assert NULL_BLOCK_ID not in table_ids(mgr, "a", 1)
    free_before = mgr.pool.num_free_blocks
    # From 12 the window starts at 5: block 0 goes.
    grown = grow(mgr, "a", 12, 14)
    assert grown is not None and [len(ids) for ids in grown] == [1, 1]
    sliding = table_ids(mgr, "a", 1)
    assert sliding[0] == NULL_BLOCK_ID and NULL_BLOCK_ID not in sliding[1:]
    assert NULL_BLOCK_ID not in table_ids(mgr, "a", 0)                # full: keeps them all
    # Given back first, it holds no hash, so it heads the free queue: this grow reuses it.
    assert result.block_ids[1][0] in grown[0] + grown[1]
    assert mgr.pool.num_free_blocks == free_before - 1
    # From 16 the window starts at 9: blocks 0 and 1 are out; 2 new, 1 more freed.
    grow(mgr, "a", 14, 16)
    grow(mgr, "a", 16, 17)
    assert table_ids(mgr, "a", 1)[:2] == [NULL_BLOCK_ID] * 2
    assert held(mgr, "a", 1) == 3 and held(mgr, "a", 0) == 5


def test_a_grow_without_the_start_frees_nothing() -> None:
    mgr = manager()
    admit(mgr, "a", 10, [])
    grow(mgr, "a", 0, 30)                       # num_computed_tokens 0 (its wire default)
    assert NULL_BLOCK_ID not in table_ids(mgr, "a", 1)


def test_a_grow_past_the_tokens_it_grows_to_is_refused() -> None:
    mgr = manager()
    admit(mgr, "a", 10, [])
    reply = mgr.apply(PlanRequest(0, 1, [], [GrowOp("a", 12, [], 13)], []))
    assert reply.error is not None and "computed" in reply.error


def test_a_grow_fits_on_the_blocks_it_gives_back() -> None:
    # 1 null + 6 usable blocks: the request holds all 6, and the decode's new block in each
    # group fits only because the sliding group gives back one first (and the full group...
    # does not: so the sliding-only model is the one that fits).
    mgr = manager(num_blocks=7, windows=(WINDOW,))
    admit(mgr, "a", 24, [])
    assert mgr.pool.num_free_blocks == 0
    assert grow(mgr, "a", 24, 25) is not None
    assert held(mgr, "a", 0) <= max_blocks_in_window(WINDOW, BLOCK_SIZE)


@pytest.mark.parametrize("save_chunk_tokens", [0, 256])
def test_a_4000_token_request_holds_a_window_of_blocks_per_sliding_group(
        save_chunk_tokens: int) -> None:
    """Window 256, blocks of 16: a 3,000-token prompt in chunks of 512, then decodes up to
    4,000 tokens. At every decode step each sliding group holds at most ceil(256 / 16) + 1
    = 17 blocks (a prefill chunk adds its own blocks: `max_blocks_in_window` of the chunk),
    while the full group holds them all. With a KV store saving chunks of 256 tokens, the
    chunk in progress is kept too."""
    block_size, window, chunk = 16, 256, 512
    windows = (0, window, window, window)                 # a 3 sliding : 1 full hybrid
    mgr = manager(num_blocks=1000, windows=windows, block_size=block_size,
                  save_chunk_tokens=save_chunk_tokens)
    bound = -(-window // block_size) + 1
    decode_bound = max_blocks_in_window(window, block_size, 1, save_chunk_tokens)
    assert decode_bound == (bound if not save_chunk_tokens else 256 // 16 + 1)
    admit(mgr, "long", 3000, [], max_new=chunk)
    num_computed, most = chunk, 0
    while num_computed < 4000:
        num_new = min(chunk, 3000 - num_computed) if num_computed < 3000 else 1
        assert grow(mgr, "long", num_computed, num_computed + num_new) is not None
        num_computed += num_new
        for group in (1, 2, 3):
            num_held = held(mgr, "long", group)
            assert num_held <= max_blocks_in_window(window, block_size, num_new,
                                                    save_chunk_tokens)
            if num_new == 1:
                assert num_held <= decode_bound
            most = max(most, num_held)
        assert held(mgr, "long", 0) == -(-num_computed // block_size)
    if not save_chunk_tokens:
        assert held(mgr, "long", 1) <= bound
    # Used blocks: the full group's 250 and about a window per sliding group, where all-full
    # attention would take 4 x 250.
    assert mgr.pool.num_used_blocks <= 250 + 3 * decode_bound < 2 * 250
    mgr.apply(PlanRequest(0, 2, ["long"], [], []))
    assert mgr.pool.num_free_blocks == mgr.pool.num_blocks


def test_a_sliding_hit_needs_only_the_window_and_a_sliding_miss_shortens_it() -> None:
    mgr = manager()
    prompt = hashes(1, 6)                                 # 24 tokens, 6 full blocks
    first = admit(mgr, "a", 24, prompt)
    mgr.apply(PlanRequest(0, 2, ["a"], [], []))            # every block evictable, cached
    # A 30-token request with the same 24 first tokens: the next query (position 24) reads
    # 17..24, i.e. blocks 4 and 5 of the sliding group; blocks 0..3 stay the null block.
    second = admit(mgr, "b", 30, prompt + [999])
    assert second.num_cached_tokens == 24
    assert second.block_ids[0][:6] == first.block_ids[0]
    assert second.block_ids[1][:4] == [NULL_BLOCK_ID] * 4
    assert second.block_ids[1][4:6] == first.block_ids[1][4:6]
    for block_id in first.block_ids[1][:4]:                # not taken, still evictable
        assert mgr.pool.blocks[block_id].ref_cnt == 0
    mgr.apply(PlanRequest(0, 3, ["b"], [], []))
    # Block 5 of the sliding group evicted: a 24-token hit would need it; 20 tokens need
    # blocks 3 and 4 only.
    evicted = mgr.pool.blocks[first.block_ids[1][5]]
    mgr.pool.free_queue.remove(evicted)
    mgr.pool.free_queue.appendleft(evicted)
    mgr.pool.free_blocks(mgr.pool.get_new_blocks(1))
    assert mgr.pool.get_cached_block(prompt[5], 1) is None
    assert mgr.pool.get_cached_block(prompt[5], 0) is not None   # the full group's is there
    assert mgr.num_cached_prefix_blocks(prompt) == 5       # what routing sees
    third = admit(mgr, "c", 30, prompt + [999])
    assert third.num_cached_tokens == 20
    assert third.block_ids[1][:3] == [NULL_BLOCK_ID] * 3


def test_each_group_has_its_own_index_and_events() -> None:
    mgr = manager(record_events=True)
    result = admit(mgr, "a", 9, hashes(1, 2))
    events = mgr.drain_events()
    assert events == [BlockStored(hashes(1, 2), 0), BlockStored(hashes(1, 2), 1)]
    for group in (0, 1):
        for i, block_hash in enumerate(hashes(1, 2)):
            block = mgr.pool.get_cached_block(block_hash, group)
            assert block is not None and block.block_id == result.block_ids[group][i]


def test_committed_blocks_the_window_leaves_stay_cached_for_later_hits() -> None:
    mgr = manager()
    prompt = hashes(3, 8)
    admit(mgr, "a", 9, prompt[:2], max_new=9)
    # A chunk from 9 to 33 fills blocks 2..7; the next grow gives back blocks 0..5 of the
    # sliding group, which keep their hashes (evictable).
    grow(mgr, "a", 9, 33, prompt[2:8])
    grow(mgr, "a", 33, 34)
    freed = [b for b in table_ids(mgr, "a", 1)[:6]]
    assert freed == [NULL_BLOCK_ID] * 6
    assert all(mgr.pool.get_cached_block(h, 1) is not None for h in prompt)
    assert admit(mgr, "b", 40, prompt).num_cached_tokens == 32


def test_free_and_preemption_return_every_groups_blocks() -> None:
    mgr = manager(windows=(0, WINDOW, 16))
    admit(mgr, "a", 20, hashes(1, 5))
    admit(mgr, "b", 6, [])
    grow(mgr, "a", 20, 30)
    grow(mgr, "b", 6, 7)
    mgr.apply(PlanRequest(0, 3, ["a", "b"], [], []))
    assert mgr.pool.num_free_blocks == mgr.pool.num_blocks and not mgr.requests
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_a_store_chunk_in_progress_keeps_its_blocks_until_complete() -> None:
    mgr = manager(save_chunk_tokens=16)
    admit(mgr, "a", 12, [])
    grow(mgr, "a", 12, 13)             # window from 5: block 0 would go, but chunk 0 is open
    assert NULL_BLOCK_ID not in table_ids(mgr, "a", 1)
    grow(mgr, "a", 13, 16)
    grow(mgr, "a", 16, 17)             # chunk 0 complete (copied out by the step that did it)
    assert table_ids(mgr, "a", 1)[:2] == [NULL_BLOCK_ID] * 2
    assert first_kept_block(WINDOW, 16, BLOCK_SIZE, 16) == 2


def test_random_plans_keep_a_hybrid_pool_consistent() -> None:
    rng = random.Random(1)
    windows = (0, WINDOW, 12)
    mgr = manager(num_blocks=80, windows=windows)
    covered: dict[str, int] = {}
    for plan_id in range(400):
        live = list(mgr.requests)
        freed = rng.sample(live, k=min(len(live), rng.randint(0, 2)))
        grows = []
        for rid in live:
            if rid not in freed and rng.random() < 0.7:
                num_tokens = covered[rid] + rng.randint(0, 6)
                num_full = num_tokens // BLOCK_SIZE - mgr.requests[rid].num_committed_blocks
                grows.append(GrowOp(rid, num_tokens, [rng.randint(0, 30)
                                                      for _ in range(num_full)], covered[rid]))
        admits = [AdmitOp(f"r{plan_id}.{i}", n, hashes(rng.randint(0, 3), n // BLOCK_SIZE),
                          rng.randint(1, 24), rng.random() < 0.5)
                  for i, n in enumerate(rng.randint(1, 40) for _ in range(rng.randint(0, 3)))]
        reply = mgr.apply(PlanRequest(0, plan_id, freed, grows, admits))
        assert reply.error is None
        for op, grown in zip(grows, reply.grown, strict=True):
            if grown is not None:
                covered[op.request_id] = op.num_tokens
        for result in reply.admitted:
            covered[result.request_id] = result.num_cached_tokens + result.num_new_tokens
        for rid in freed:
            covered.pop(rid)
        _check(mgr, windows)
    mgr.apply(PlanRequest(0, 999, list(mgr.requests), [], []))
    assert mgr.pool.num_free_blocks == mgr.pool.num_blocks


def _check(mgr: ReplicaBlockManager, windows: tuple[int, ...]) -> None:
    pool = mgr.pool
    ref_cnts = [0] * len(pool.blocks)
    for state in mgr.requests.values():
        for group, ids in enumerate(state.block_ids()):
            first = state.num_freed[group]
            assert ids[:first] == [NULL_BLOCK_ID] * first
            assert NULL_BLOCK_ID not in ids[first:] and len(set(ids[first:])) == len(ids) - first
            for block_id in ids[first:]:
                ref_cnts[block_id] += 1
            if windows[group] == 0:
                assert first == 0
    assert [b.ref_cnt for b in pool.blocks] == ref_cnts
    assert sorted(pool.free_queue.block_ids()) == [
        i for i, n in enumerate(ref_cnts) if n == 0 and i != NULL_BLOCK_ID]
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.get_cached_block(block.block_hash, block.cache_group) is block
