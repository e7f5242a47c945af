"""The interface every KV store tier implements, and its stats.

`KvStore` (store.py) layers tiers, fastest first: what one tier pushes out to make room goes to
the next. A new tier (a remote object store, another node's memory) is a new `StoreTier`;
nothing above it changes. A tier in memory is not thread-safe: `KvStore` calls it under its
lock. A tier that does I/O (`locks_itself`) guards its own index with a lock held only for
index updates, never across a read or write, so the store calls it outside its lock.
"""

from abc import ABC, abstractmethod

from services.kv_chunks import KvChunk, layer_range
from services.kv_store_wire import ChunkKey, TierStats


class StoreTier(ABC):
    """One level of the store: a byte budget, least recently used chunks leave first."""

    name: str
    locks_itself = False    # True: thread-safe, and called outside the store's lock

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Held here? Touches nothing (no LRU update, no read)."""

    @abstractmethod
    def keys(self) -> list[ChunkKey]:
        """Every key held, least recently used first."""

    @abstractmethod
    def get(self, key: ChunkKey) -> KvChunk | None:
        """The chunk, made most recently used; None when not held. A tier that can find a
        chunk damaged (a file) checks it first, and deletes and counts one that fails: a
        damaged chunk is a miss, never returned."""

    def held_bytes(self, key: ChunkKey) -> int | None:
        """What the chunk takes here (None: not held, or this tier cannot say cheaply)."""
        return None

    def get_layers(self, key: ChunkKey, start: int, end: int) -> KvChunk | None:
        """Layers [start, end) of the chunk (`services.kv_chunks.layer_range`), made most
        recently used; None when not held, or it has fewer layers. A tier that reads from
        storage reads (and checks) only the range."""
        chunk = self.get(key)
        return None if chunk is None else layer_range(chunk, start, end)

    @abstractmethod
    def put(self, chunk: KvChunk, want_evicted: bool) -> list[KvChunk]:
        """Holds `chunk` (already held: only made most recently used), evicting least recently
        used chunks to fit it. Returns what left the tier (the chunk itself when it is larger
        than the whole budget), for the next tier; `want_evicted` False when there is none,
        so a tier need not read back what it deletes."""

    @abstractmethod
    def remove(self, key: ChunkKey) -> bool:
        """Forgets one chunk; False when it was not held."""

    @abstractmethod
    def clear(self) -> int:
        """Forgets every chunk; returns how many."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    def close(self) -> None:  # noqa: B027  (a tier with nothing open needs no close)
        """Releases what the tier holds open (files, locks, connections)."""
