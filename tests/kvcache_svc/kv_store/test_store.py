"""KvStore: leading-prefix lookups, all-or-nothing saves, counters, and the tiers layered
(memory spills to disk, disk hits come back up, a damaged disk chunk is a miss)."""

import threading
from pathlib import Path

import msgspec
import pytest

from kvcache_svc.kv_store.disk_tier import DiskTier
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import ChunkRejected, KvStore
from services.kv_chunks import KvChunk
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, chunk, key


def memory_store(capacity_bytes: int = 1 << 20) -> KvStore:
    return KvStore([MemoryTier(capacity_bytes)], chunk_tokens=CHUNK_TOKENS)


def save(store: KvStore, chunks: list[KvChunk]) -> tuple[int, int]:
    return store.save([(c.header, c.data) for c in chunks])


def test_lookup_counts_the_leading_chunks_held() -> None:
    store = memory_store()
    save(store, [chunk(0), chunk(1), chunk(3)])
    assert store.lookup([key(i) for i in range(5)]) == 2     # 2 is missing: 3 is useless
    assert store.lookup([key(3), key(2)]) == 1
    assert store.lookup([key(2)]) == 0 and store.lookup([]) == 0
    assert store.lookup_many([[key(0)], [key(1), key(2)], []]) == [1, 1, 0]
    stats = store.stats()
    assert stats.num_hit_tokens == (2 + 1 + 1 + 1) * CHUNK_TOKENS
    assert stats.num_miss_tokens == (3 + 1 + 1 + 1) * CHUNK_TOKENS


def test_saving_only_what_is_not_held_yet() -> None:
    # Chunks 0..3 are stored; a longer request (0..5) looks up first and sends only 4..5.
    store = memory_store()
    assert save(store, [chunk(i) for i in range(4)]) == (4, 0)
    keys = [key(i) for i in range(6)]
    num_held = store.lookup(keys)
    assert num_held == 4
    assert save(store, [chunk(i) for i in range(num_held, 6)]) == (2, 0)
    stats = store.stats()
    assert stats.num_stored_chunks == 6 and stats.num_stored_tokens == 6 * CHUNK_TOKENS
    assert stats.num_stored_bytes == 6 * 1024 and stats.num_skipped_tokens == 0
    # A caller that sends everything again stores nothing new; the store counts the waste.
    assert save(store, [chunk(i) for i in range(6)]) == (0, 6)
    assert store.stats().num_skipped_tokens == 6 * CHUNK_TOKENS


def test_a_bad_chunk_refuses_the_whole_save() -> None:
    store = memory_store()
    good, bad = chunk(0), chunk(1)
    damaged = bytearray(bad.data)
    damaged[10] ^= 0xFF
    with pytest.raises(ChunkRejected, match="chunk 1: checksum mismatch"):
        store.save([(good.header, good.data), (bad.header, bytes(damaged))])
    with pytest.raises(ChunkRejected, match="data of 1023 bytes"):
        store.save([(good.header, bytes(good.data)[:-1])])
    wrong_size = msgspec.structs.replace(good.header, num_bytes=1000)
    with pytest.raises(ChunkRejected, match="header says 1000 bytes"):
        store.save([(wrong_size, good.data)])
    too_long = chunk(2, num_tokens=2 * CHUNK_TOKENS)
    with pytest.raises(ChunkRejected, match="at most 16"):
        store.put(too_long.header, too_long.data)
    assert store.lookup([key(0)]) == 0 and store.stats().num_stored_chunks == 0


def test_get_and_load_count_what_they_serve() -> None:
    store = memory_store()
    save(store, [chunk(0), chunk(1)])
    found = store.get(key(0))
    assert found is not None and bytes(found.data) == bytes(chunk(0).data)
    assert store.get(key(7)) is None
    loaded = store.load([key(1), key(7), key(0)], max_bytes=1 << 20)
    assert [c is not None for c in loaded] == [True, False, True]
    stats = store.stats()
    assert (stats.num_loaded_chunks, stats.num_loaded_tokens, stats.num_loaded_bytes) == (
        3, 3 * CHUNK_TOKENS, 3 * 1024)
    assert stats.num_load_miss_tokens == 2 * CHUNK_TOKENS


def test_load_answers_a_prefix_within_the_byte_limit() -> None:
    store = memory_store()
    save(store, [chunk(i) for i in range(4)])
    keys = [key(i) for i in range(4)]
    assert len(store.load(keys, max_bytes=2 * 1024)) == 2
    assert len(store.load(keys, max_bytes=2 * 1024 - 1)) == 1
    assert len(store.load(keys, max_bytes=0)) == 1           # always at least one
    assert len(store.load([key(9), *keys], max_bytes=1024)) == 2   # a miss costs nothing


def test_memory_evictions_spill_to_disk_and_disk_hits_come_back_up(tmp_path: Path) -> None:
    memory = MemoryTier(capacity_bytes=2 * 1024)
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20)
    store = KvStore([memory, disk], chunk_tokens=CHUNK_TOKENS)
    save(store, [chunk(i) for i in range(4)])
    assert [memory.contains(key(i)) for i in range(4)] == [False, False, True, True]
    assert [disk.contains(key(i)) for i in range(4)] == [True, True, False, False]
    assert store.lookup([key(i) for i in range(4)]) == 4

    found = store.get(key(0))                               # from disk, promoted
    assert found is not None and bytes(found.data) == bytes(chunk(0).data)
    assert memory.contains(key(0)) and disk.contains(key(0))
    assert not memory.contains(key(2)) and disk.contains(key(2))   # pushed down in turn
    stats = store.stats()
    assert [t.name for t in stats.tiers] == ["memory", "disk"]
    assert stats.tier("memory").num_chunks == 2             # type: ignore[union-attr]
    assert stats.tier("disk").num_chunks == 3               # type: ignore[union-attr]
    store.close()


def test_a_chunk_no_tier_can_hold_is_not_counted_as_stored() -> None:
    store = memory_store(capacity_bytes=1000)
    assert save(store, [chunk(0, num_elements=400), chunk(1)]) == (1, 0)
    assert store.stats().num_stored_chunks == 1 and store.lookup([key(1)]) == 0


def test_chunks_larger_than_memory_go_straight_to_disk(tmp_path: Path) -> None:
    store = KvStore([MemoryTier(0), DiskTier(tmp_path, 1 << 20)], chunk_tokens=CHUNK_TOKENS)
    save(store, [chunk(0)])
    assert store.lookup([key(0)]) == 1 and store.get(key(0)) is not None
    store.close()


def test_the_disk_tier_survives_a_new_store(tmp_path: Path) -> None:
    first = KvStore([MemoryTier(2 * 1024), DiskTier(tmp_path, 1 << 20)], CHUNK_TOKENS)
    save(first, [chunk(i) for i in range(4)])
    assert first.stats().tier("disk").num_chunks == 2       # type: ignore[union-attr]
    first.close()                                           # writes memory's 2 and 3 down
    second = KvStore([MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)], CHUNK_TOKENS)
    assert second.stats().tier("disk").num_chunks == 4      # type: ignore[union-attr]
    assert second.lookup([key(i) for i in range(5)]) == 4
    for i in range(4):
        found = second.get(key(i))
        assert found is not None and bytes(found.data) == bytes(chunk(i).data)
    second.close()


def test_a_crash_keeps_only_what_went_down(tmp_path: Path) -> None:
    first = KvStore([MemoryTier(2 * 1024), DiskTier(tmp_path, 1 << 20)], CHUNK_TOKENS)
    save(first, [chunk(i) for i in range(4)])
    first.tiers[1].close()                                  # no flush: as if killed
    second = KvStore([MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 20)], CHUNK_TOKENS)
    assert second.lookup([key(0), key(1)]) == 2 and second.lookup([key(2)]) == 0
    second.close()


def test_a_damaged_disk_chunk_is_a_miss_not_data(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    store = KvStore([MemoryTier(0), disk], chunk_tokens=CHUNK_TOKENS)
    save(store, [chunk(0)])
    path = tmp_path / disk.file_name(key(0))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(bytes(raw))
    assert store.get(key(0)) is None
    stats = store.stats()
    assert stats.tier("disk").num_dropped_chunks == 1       # type: ignore[union-attr]
    assert stats.num_load_miss_tokens == CHUNK_TOKENS and stats.num_loaded_chunks == 0
    assert store.lookup([key(0)]) == 0
    store.close()


def test_stats_are_a_frozen_snapshot() -> None:
    store = memory_store()
    before = store.stats()
    save(store, [chunk(0)])
    assert before.num_stored_chunks == 0 and store.stats().num_stored_chunks == 1
    with pytest.raises(AttributeError):   # a frozen struct
        before.num_stored_chunks = 5  # type: ignore[misc]


def test_threads_may_share_a_store(tmp_path: Path) -> None:
    store = KvStore([MemoryTier(8 * 1024), DiskTier(tmp_path, 1 << 20)], CHUNK_TOKENS)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(offset, offset + 40):
                save(store, [chunk(i)])
                found = store.get(key(i - 3)) if i >= offset + 3 else None
                assert found is None or bytes(found.data) == bytes(chunk(i - 3).data)
                store.stats()
        except BaseException as exc:   # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(100 * n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.stats().num_stored_chunks == 160
    assert store.lookup([key(100 * n + i) for n in range(4) for i in range(40)]) == 160
    store.close()
