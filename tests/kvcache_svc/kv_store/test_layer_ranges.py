"""Ranges of a chunk's layers, as a layer-wise load asks for them (issue 24, point 2): the disk
tier reads and checks only the range's bytes (a damaged layer outside it goes unnoticed until
it is asked for, and is then dropped), and the store serves a range from memory, promoting a
chunk found on disk with the first range, or from disk alone when memory cannot hold it."""

import hashlib
from pathlib import Path

import pytest

from kvcache_svc.kv_store.disk_tier import DiskTier
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.kv_chunks import KvChunk, layer_range, make_chunk
from services.kv_store_wire import ChunkKey, KvSlice
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, block_hash

NUM_LAYERS = 6
LAYER_ELEMENTS = 256              # float16: 512 bytes per layer


SLICE = KvSlice("test-model", "float16", 0, NUM_LAYERS, 0, 4)


def key(i: int) -> ChunkKey:
    return SLICE.key(block_hash(i), CHUNK_TOKENS)


def layered(i: int) -> KvChunk:
    data = hashlib.shake_256(b"layers %d" % i).digest(NUM_LAYERS * LAYER_ELEMENTS * 2)
    return make_chunk(key(i), (NUM_LAYERS, LAYER_ELEMENTS), data)


def test_the_disk_tier_reads_and_checks_only_the_range(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    whole = layered(0)
    tier.put(whole, want_evicted=False)
    part = tier.get_layers(key(0), 2, 4)
    expected = layer_range(whole, 2, 4)
    assert part is not None and expected is not None
    assert part.header == expected.header and bytes(part.data) == bytes(expected.data)
    assert tier.get_layers(key(0), 5, 7) is None and tier.contains(key(0))  # too few layers
    assert tier.get_layers(key(9), 0, 1) is None

    [path] = tmp_path.glob("*.kvchunk")
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 512 * 2 + 10] ^= 0xFF          # a byte of layer 4
    path.write_bytes(bytes(raw))
    assert tier.get_layers(key(0), 0, 4) is not None      # layers 0-3 read and checked alone
    assert tier.get_layers(key(0), 3, 6) is None          # layer 4 is damaged: dropped
    assert not tier.contains(key(0)) and not path.exists()
    assert tier.stats().num_dropped_chunks == 1
    tier.close()


def test_a_range_of_a_chunk_on_disk_promotes_it_with_the_first_range(tmp_path: Path) -> None:
    memory = MemoryTier(capacity_bytes=1 << 20)
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20)
    store = KvStore([memory, disk], chunk_tokens=CHUNK_TOKENS)
    disk.put(layered(0), want_evicted=False)                # only on disk
    [first] = store.load([key(0)], 1 << 30, (0, 2))
    assert first is not None and first.header.shape == (2, LAYER_ELEMENTS)
    assert memory.contains(key(0))                          # read whole, copied up
    assert store.stats().num_loaded_chunks == 0             # counted with its last range
    [later] = store.load([key(0)], 1 << 30, (2, 6))
    assert later is not None and bytes(later.data) == bytes(layered(0).data)[2 * 512:]
    stats = store.stats()
    assert (stats.num_loaded_chunks, stats.num_loaded_tokens) == (1, CHUNK_TOKENS)  # once
    assert stats.num_loaded_bytes == layered(0).num_bytes
    store.close()


def test_memory_too_small_for_a_chunk_serves_every_range_from_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even the first range is read alone: the whole chunk could not come up anyway."""
    memory = MemoryTier(capacity_bytes=1024)                # less than one chunk
    disk = DiskTier(tmp_path, capacity_bytes=1 << 20)
    store = KvStore([memory, disk], chunk_tokens=CHUNK_TOKENS)
    store.put(layered(0).header, layered(0).data)
    assert disk.contains(key(0)) and not memory.contains(key(0))

    def whole_read(*_: object) -> None:
        raise AssertionError("read the whole chunk")

    monkeypatch.setattr(disk, "get", whole_read)
    parts = [store.load([key(0)], 1 << 30, (lo, lo + 2))[0] for lo in (0, 2, 4)]
    assert all(p is not None for p in parts)
    assert b"".join(bytes(p.data) for p in parts if p is not None) == bytes(layered(0).data)
    assert not memory.contains(key(0))
    assert store.load([key(0)], 1 << 30, (4, 7)) == [None]  # past its layers: a miss
    store.close()
