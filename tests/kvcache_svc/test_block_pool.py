"""BlockPool and FreeBlockQueue: LRU order, null block, eviction, ref counts, the IndexLog of
prefix-index changes and the read-only prefix lookup."""

import pytest

from kvcache_svc.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, IndexLog, KVBlock


def ids(blocks: list[KVBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_operations_keep_order_and_count() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])                       # from the middle
    queue.appendleft(blocks[2])
    queue.remove(blocks[4])                       # the tail
    assert queue.block_ids() == [2, 0, 1, 3]
    assert queue.popleft() is blocks[2]
    queue.append(blocks[4])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert len(queue) == 4
    with pytest.raises(ValueError):
        queue.append(blocks[0])                   # already queued
    with pytest.raises(ValueError):
        queue.remove(blocks[2])                   # not queued
    for _ in range(4):
        queue.popleft()
    assert len(queue) == 0 and queue.block_ids() == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=5)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in ids(blocks)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(blocks))
    assert NULL_BLOCK_ID not in pool.free_queue.block_ids()
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=7)
    first = pool.get_new_blocks(3)                # 1, 2, 3
    for i, block in enumerate(first):
        pool.cache_block(block, 100 + i)
    pool.free_blocks([first[1]])
    pool.free_blocks([first[0]])
    # Never-used blocks come first, then the freed ones in the order they were freed.
    assert pool.free_queue.block_ids() == [4, 5, 6, 2, 1]
    assert ids(pool.get_new_blocks(4)) == [4, 5, 6, 2]


def test_reverse_order_free_evicts_a_request_tail_first() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 10 + i)
    pool.free_blocks(reversed(blocks))
    assert pool.num_cached_blocks == 3            # freed blocks stay findable
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[2]
    assert pool.get_cached_block(12) is None      # the tail's hash went with it
    assert pool.get_cached_block(10) is blocks[0]
    assert pool.get_cached_block(11) is blocks[1]
    assert evicted.block_hash is None and pool.num_cached_blocks == 2


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(num_blocks=3)
    cached, plain = pool.get_new_blocks(2)
    pool.cache_block(cached, 7)
    pool.free_blocks([cached, plain])
    assert pool.free_queue.block_ids() == [plain.block_id, cached.block_id]


def test_touch_takes_evictable_blocks_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, 42)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(42)
    assert hit is block
    pool.touch([hit])
    pool.touch([hit])                             # a second request shares it
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 2
    assert block.block_id not in pool.free_queue.block_ids()
    pool.free_blocks([hit])
    assert pool.num_free_blocks == 2              # still held once
    pool.free_blocks([hit])
    assert pool.num_free_blocks == 3 and pool.get_cached_block(42) is hit


def test_cache_block_keeps_one_block_per_hash() -> None:
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 5)
    assert not pool.cache_block(b, 5)             # same prefix computed twice
    assert not pool.cache_block(a, 6)             # a block has one hash
    assert b.block_hash is None and pool.get_cached_block(5) is a


def test_clear_cache_drops_only_unreferenced_blocks() -> None:
    pool = BlockPool(num_blocks=5)
    held, freed = pool.get_new_blocks(2)
    pool.cache_block(held, 1)
    pool.cache_block(freed, 2)
    pool.free_blocks([freed])
    assert pool.clear_cache() == 1
    assert pool.get_cached_block(1) is held and pool.get_cached_block(2) is None
    assert freed.block_hash is None and pool.num_cached_blocks == 1
    assert pool.free_queue.block_ids()[0] == freed.block_id  # worthless now: reused first


def test_pool_size_is_bounded() -> None:
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)


def test_index_log_records_every_index_change_in_order() -> None:
    log = IndexLog()
    pool = BlockPool(num_blocks=4, index_log=log)  # 3 usable blocks
    a, b, c = pool.get_new_blocks(3)
    assert log.drain() == []                      # nothing was cached yet
    pool.cache_block(a, 10)
    pool.cache_block(b, 11)
    assert not pool.cache_block(c, 10)            # left out of the index: not recorded
    pool.free_blocks([b, a])                      # evictable, still indexed: not recorded
    pool.free_blocks([c])
    assert log.drain() == [(True, 0, [10, 11])]
    assert log.drain() == []                      # drained

    pool.get_new_blocks(2)                        # c (no hash), then b: evicts 11
    pool.cache_block(c, 12)
    pool.get_new_blocks(1)                        # a: evicts 10
    assert log.drain() == [(False, 0, [11]), (True, 0, [12]), (False, 0, [10])]


def test_index_log_records_clear_cache() -> None:
    log = IndexLog()
    pool = BlockPool(num_blocks=5, index_log=log)
    held, freed, freed_too = pool.get_new_blocks(3)
    for block, block_hash in ((held, 1), (freed, 2), (freed_too, 3)):
        pool.cache_block(block, block_hash)
    pool.free_blocks([freed_too, freed])
    log.drain()
    assert pool.clear_cache() == 2
    assert log.drain() == [(False, 0, [2, 3])]       # held keeps its hash


def test_prefix_lookup_stops_at_the_first_miss_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(3)
    for block, block_hash in zip(blocks, (1, 2, 3)):
        pool.cache_block(block, block_hash)
    pool.free_blocks(reversed(blocks[1:]))        # 2 and 3 evictable, 1 held
    free_order = pool.free_queue.block_ids()
    ref_cnts = [block.ref_cnt for block in pool.blocks]
    assert pool.num_cached_prefix_blocks([1, 2, 3]) == 3
    assert pool.num_cached_prefix_blocks([1, 9, 3]) == 1
    assert pool.num_cached_prefix_blocks([9, 1]) == 0
    assert pool.num_cached_prefix_blocks([]) == 0
    assert pool.free_queue.block_ids() == free_order
    assert [block.ref_cnt for block in pool.blocks] == ref_cnts
