"""MemoryTier: LRU eviction under the byte budget; what leaves is handed back."""

from kvcache_svc.kv_store.memory_tier import MemoryTier
from tests.kvcache_svc.kv_store.common import chunk, key


def test_least_recently_used_chunks_leave_first() -> None:
    tier = MemoryTier(capacity_bytes=3 * 1024)          # three chunks of 1 KiB
    for i in range(3):
        assert tier.put(chunk(i), want_evicted=True) == []
    assert tier.get(key(0)) is not None                 # 0 is now the most recently used
    evicted = tier.put(chunk(3), want_evicted=True)
    assert [c.key for c in evicted] == [key(1)]
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    stats = tier.stats()
    assert (stats.num_chunks, stats.num_bytes, stats.num_evicted_chunks) == (3, 3 * 1024, 1)


def test_contains_does_not_touch_the_lru_order() -> None:
    tier = MemoryTier(capacity_bytes=2 * 1024)
    tier.put(chunk(0), want_evicted=False)
    tier.put(chunk(1), want_evicted=False)
    assert tier.contains(key(0))
    assert tier.put(chunk(2), want_evicted=False) == []  # nobody below: nothing handed back
    assert not tier.contains(key(0)) and tier.contains(key(1))


def test_a_chunk_held_is_not_stored_twice() -> None:
    tier = MemoryTier(capacity_bytes=4096)
    tier.put(chunk(0), want_evicted=True)
    assert tier.put(chunk(0), want_evicted=True) == []
    assert tier.stats().num_bytes == 1024


def test_a_chunk_larger_than_the_budget_is_handed_back_untouched() -> None:
    tier = MemoryTier(capacity_bytes=1000)
    tier.put(chunk(0, num_elements=400), want_evicted=True)
    big = chunk(1)                                      # 1024 bytes
    assert tier.put(big, want_evicted=True) == [big]
    assert tier.contains(key(0)) and not tier.contains(key(1))
    assert MemoryTier(0).put(big, want_evicted=True) == [big]


def test_remove_and_clear_give_the_bytes_back() -> None:
    tier = MemoryTier(capacity_bytes=4096)
    for i in range(3):
        tier.put(chunk(i), want_evicted=False)
    assert tier.remove(key(1)) and not tier.remove(key(1))
    assert tier.stats().num_bytes == 2048
    assert tier.clear() == 2
    assert tier.stats().num_bytes == 0 and tier.get(key(0)) is None
