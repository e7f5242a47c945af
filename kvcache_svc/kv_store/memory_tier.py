"""Host-memory tier of the KV store: chunks in an LRU map under a byte budget.

Data is held as received (a memoryview of the ZMQ frame, no copy) and was checked against its
header's checksum when it entered the store, so it is served without checking again.
"""

from collections import OrderedDict

from kvcache_svc.kv_store.tier import StoreTier, TierStats
from services.kv_chunks import KvChunk
from services.kv_store_wire import ChunkKey


class MemoryTier(StoreTier):
    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._chunks: OrderedDict[ChunkKey, KvChunk] = OrderedDict()  # oldest first
        self.num_bytes = 0
        self.num_evicted_chunks = 0

    def contains(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def keys(self) -> list[ChunkKey]:
        return list(self._chunks)

    def get(self, key: ChunkKey) -> KvChunk | None:
        chunk = self._chunks.get(key)
        if chunk is not None:
            self._chunks.move_to_end(key)
        return chunk

    def put(self, chunk: KvChunk, want_evicted: bool) -> list[KvChunk]:
        if chunk.key in self._chunks:
            self._chunks.move_to_end(chunk.key)
            return []
        if chunk.num_bytes > self.capacity_bytes:
            return [chunk]
        evicted: list[KvChunk] = []
        while self.num_bytes + chunk.num_bytes > self.capacity_bytes:
            _, old = self._chunks.popitem(last=False)
            self.num_bytes -= old.num_bytes
            self.num_evicted_chunks += 1
            if want_evicted:
                evicted.append(old)
        self._chunks[chunk.key] = chunk
        self.num_bytes += chunk.num_bytes
        return evicted

    def remove(self, key: ChunkKey) -> bool:
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            return False
        self.num_bytes -= chunk.num_bytes
        return True

    def clear(self) -> int:
        num_chunks = len(self._chunks)
        self._chunks.clear()
        self.num_bytes = 0
        return num_chunks

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, len(self._chunks), self.num_bytes,
                         self.num_evicted_chunks, num_dropped_chunks=0)
