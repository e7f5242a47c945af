"""`KvStore`: the KV store's one interface, over a stack of tiers (memory, then disk, ...).

A chunk enters the first tier; what a tier pushes out to make room goes down to the next (a
chunk the last tier pushes out is gone). A hit in a lower tier is copied up into the first.
`close` (kvcache_svc's clean stop) writes every chunk down into the lowest tier that can hold
it, so a restart over the same disk directory finds what the store held, within the disk
budget; after a crash only what had already gone down is there.
Every chunk is checked against its header (sizes, checksum) before it is stored; lower tiers
check again whenever they read (tier.py). A save that extends a stored partial chunk
(`ChunkHeader.base`, services.kv_chunks) is appended to a copy of it and stored whole.

Thread-safe, and no disk I/O under the store's lock (issue 24): the lock covers the tiers that
live in memory (`StoreTier.locks_itself` False: the leading ones), the chunks on their way down
(`_spilling`, still found by lookups and loads) and the counters; a tier that does I/O locks its
own index and reads, writes and checks files outside any lock. So a lookup (the plan call's
admission) never waits for a disk, and saves and loads on other threads go on side by side.
Checksums and extensions are computed before the lock is taken.

Called by `kvcache_svc.kv_store.server` (the store's socket) and, for stats, by the admin API.
"""

import logging
import threading
from collections.abc import Sequence

from kvcache_svc.kv_store.tier import StoreTier
from services.kv_chunks import (
    KvChunk,
    chunk_extension_problem,
    chunk_problem,
    extend_chunk,
    extension_problem,
    layer_range,
)
from services.kv_store_wire import ChunkHeader, ChunkKey, StoreStats

log = logging.getLogger(__name__)


class ChunkRejected(ValueError):
    """A chunk the store will not take: data that does not match its header, or a chunk
    longer than the store's chunk size."""


class KvStore:
    def __init__(self, tiers: Sequence[StoreTier], chunk_tokens: int) -> None:
        if not tiers:
            raise ValueError("a KV store needs at least one tier")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.tiers = tuple(tiers)
        self.chunk_tokens = chunk_tokens
        # The leading tiers that live in memory (under the store's lock); the rest lock
        # themselves and may do I/O.
        self._num_locked = next((i for i, t in enumerate(self.tiers) if t.locks_itself),
                                len(self.tiers))
        if any(not t.locks_itself for t in self.tiers[self._num_locked:]):
            raise ValueError("tiers that lock themselves must come after the others")
        self._lock = threading.Lock()
        self._spilling: dict[ChunkKey, KvChunk] = {}   # pushed out, being written lower down
        self._num_hit_tokens = self._num_miss_tokens = 0
        self._num_stored_chunks = self._num_stored_tokens = self._num_stored_bytes = 0
        self._num_skipped_tokens = 0
        self._num_loaded_chunks = self._num_loaded_tokens = self._num_loaded_bytes = 0
        self._num_load_miss_tokens = 0

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading `keys` are held (chunk i is useless without 0..i-1)."""
        return self.lookup_many([keys])[0]

    def lookup_many(self, key_lists: Sequence[Sequence[ChunkKey]], record: bool = True
                    ) -> list[int]:
        """`lookup` per key list; `record` False: not counted in the hit and miss tokens.
        Index lookups only: never waits for a disk."""
        with self._lock:
            counts = []
            for keys in key_lists:
                num_held = 0
                while num_held < len(keys) and self._holds(keys[num_held]):
                    num_held += 1
                if record:
                    self._num_hit_tokens += sum(key.num_tokens for key in keys[:num_held])
                    self._num_miss_tokens += sum(key.num_tokens for key in keys[num_held:])
                counts.append(num_held)
            return counts

    def count_lookup(self, num_hit_tokens: int, num_miss_tokens: int) -> None:
        """Counts an admission's lookup in the hit and miss tokens (the replica's view asks
        once per slice, unrecorded, and counts the outcome once)."""
        with self._lock:
            self._num_hit_tokens += num_hit_tokens
            self._num_miss_tokens += num_miss_tokens

    def _holds(self, key: ChunkKey) -> bool:
        """Under the lock (a lower tier's `contains` takes only its own index lock)."""
        return key in self._spilling or any(tier.contains(key) for tier in self.tiers)

    def holds(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._holds(key)

    def check(self, header: ChunkHeader, data: bytes | memoryview) -> KvChunk:
        """The chunk, once `data` matches `header`; raises ChunkRejected otherwise. An
        extension is checked against what it claims to extend (not yet against the stored
        base: that may be gone by the time it is stored)."""
        if header.key.num_tokens > self.chunk_tokens:
            raise ChunkRejected(f"chunk of {header.key.num_tokens} tokens, the store's chunks "
                                f"hold at most {self.chunk_tokens}")
        if (problem := extension_problem(header)) is not None:
            raise ChunkRejected(f"bad extension: {problem}")
        if (problem := chunk_problem(header, data)) is not None:
            raise ChunkRejected(problem)
        return KvChunk(header, data)

    def save(self, chunks: Sequence[tuple[ChunkHeader, bytes | memoryview]]) -> tuple[int, int]:
        """Stores every chunk not held yet: (number stored, number already held); the two
        add up to fewer than `chunks` when one fit no tier, or extended a chunk no longer
        held. All or nothing: raises ChunkRejected, storing none, when any chunk fails
        `check`."""
        checked = []
        for index, (header, data) in enumerate(chunks):
            try:
                checked.append(self.check(header, data))
            except ChunkRejected as exc:
                raise ChunkRejected(f"chunk {index}: {exc}") from exc
        num_stored = num_held = 0
        for chunk in checked:
            with self._lock:
                if self._holds(chunk.key):
                    num_held += 1
                    self._num_skipped_tokens += chunk.key.num_tokens - (
                        0 if chunk.header.base is None else chunk.header.base.num_tokens)
                    continue
            # Counted as sent: an extension's new tokens and bytes, not its base's.
            num_tokens, num_bytes = chunk.key.num_tokens, chunk.num_bytes
            if chunk.header.base is not None:
                num_tokens = chunk.key.num_tokens - chunk.header.base.num_tokens
                whole = self._extended(chunk)
                if whole is None:
                    continue
                chunk = whole
            self._place(chunk)
            with self._lock:
                if not self._holds(chunk.key):      # larger than every tier's budget
                    continue
                num_stored += 1
                self._num_stored_chunks += 1
                self._num_stored_tokens += num_tokens
                self._num_stored_bytes += num_bytes
        return num_stored, num_held

    def _extended(self, extension: KvChunk) -> KvChunk | None:
        """The whole chunk an extension makes with its stored base; None when the base is no
        longer held, or does not match (logged: the saver counts it as failed)."""
        assert extension.header.base is not None
        base = self._get(extension.header.base)
        if base is None:
            log.info("KV extension to %d tokens dropped: its base (%d tokens) is not held",
                     extension.key.num_tokens, extension.header.base.num_tokens)
            return None
        if (problem := chunk_extension_problem(extension.header, base.header)) is not None:
            log.warning("KV extension dropped: %s", problem)
            return None
        return extend_chunk(base, extension.header, extension.data)

    def put(self, header: ChunkHeader, data: bytes | memoryview) -> bool:
        """Stores one chunk; False when it was already held. Raises ChunkRejected."""
        return self.save([(header, data)])[0] == 1

    def _place(self, chunk: KvChunk, first: int = 0) -> None:
        """Into tier `first`; whatever each tier pushes out goes to the next. The tiers under
        the lock first; what they push out is written lower down after it is released."""
        pending = [chunk]
        with self._lock:
            for index in range(first, self._num_locked):
                pending = self._put(index, pending)
            if self._num_locked < len(self.tiers):
                self._spilling.update((each.key, each) for each in pending)
            spilled = list(pending)
        for index in range(max(first, self._num_locked), len(self.tiers)):
            if not pending:
                break
            pending = self._put(index, pending)
        if spilled and self._num_locked < len(self.tiers):
            with self._lock:
                for each in spilled:
                    if self._spilling.get(each.key) is each:
                        del self._spilling[each.key]

    def _put(self, index: int, chunks: list[KvChunk]) -> list[KvChunk]:
        has_next = index + 1 < len(self.tiers)
        return [out for each in chunks for out in self.tiers[index].put(each, has_next)]

    def get(self, key: ChunkKey) -> KvChunk | None:
        """The chunk from the fastest tier holding it (copied up into the first tier when
        found lower); None when no tier holds it, or the one that did found it damaged."""
        return self.load([key], max_bytes=0)[0]

    def load(self, keys: Sequence[ChunkKey], max_bytes: int,
             layers: tuple[int, int] | None = None) -> list[KvChunk | None]:
        """`get` for each of a prefix of `keys`: every key, or those before the one whose
        chunk would take the total past `max_bytes` (the first key is always answered).
        `layers`: only that range of each chunk's layers (`layer_range`; a chunk with fewer
        is a miss); a layer-wise load asks for every range, so its chunks and tokens count
        with the last range only (served whole, then)."""
        answered: list[KvChunk | None] = []
        num_bytes = 0
        for key in keys:
            chunk = self._get(key) if layers is None else self._get_layers(key, *layers)
            if chunk is not None and answered and num_bytes + chunk.num_bytes > max_bytes:
                break
            answered.append(chunk)
            with self._lock:
                if chunk is None:
                    self._num_load_miss_tokens += key.num_tokens
                    continue
                num_bytes += chunk.num_bytes
                if layers is None or layers[1] >= key.layer_end - key.layer_start:
                    self._num_loaded_chunks += 1
                    self._num_loaded_tokens += key.num_tokens
                self._num_loaded_bytes += chunk.num_bytes
        return answered

    def _get(self, key: ChunkKey) -> KvChunk | None:
        """Memory tiers under the lock, lower tiers (reads and checksums) outside it."""
        with self._lock:
            for index in range(self._num_locked):
                chunk = self.tiers[index].get(key)
                if chunk is not None:
                    if index > 0:
                        self._place_locked_up(chunk)
                    return chunk
            chunk = self._spilling.get(key)
            if chunk is not None:
                return chunk
        for tier in self.tiers[self._num_locked:]:
            chunk = tier.get(key)
            if chunk is not None:
                if self._num_locked:
                    self._place(chunk)
                return chunk
        return None

    def _get_layers(self, key: ChunkKey, start: int, end: int) -> KvChunk | None:
        """Layers [start, end) of the chunk (`layer_range`: nothing hashed). A layer-wise
        load's first range takes the whole chunk as `_get` does (copied up into memory when
        found lower), unless the first memory tier could not hold it; any other range found
        only below the memory tiers (pushed out since, or too large for them) is read alone
        from there, so a hit on disk reads each byte once."""
        if start == 0 and self._may_come_up(key):
            chunk = self._get(key)
            return None if chunk is None else layer_range(chunk, start, end)
        with self._lock:
            for index in range(self._num_locked):
                chunk = self.tiers[index].get(key)
                if chunk is not None:
                    return layer_range(chunk, start, end)
            chunk = self._spilling.get(key)
            if chunk is not None:
                return layer_range(chunk, start, end)
        for tier in self.tiers[self._num_locked:]:
            part = tier.get_layers(key, start, end)
            if part is not None:
                return part
        return None

    def _may_come_up(self, key: ChunkKey) -> bool:
        """Whether the first memory tier could hold the chunk, as far as a lower tier says."""
        if not self._num_locked:
            return False
        capacity = getattr(self.tiers[0], "capacity_bytes", None)
        sizes = [tier.held_bytes(key) for tier in self.tiers[self._num_locked:]]
        size = next((n for n in sizes if n is not None), None)
        return capacity is None or size is None or size <= capacity

    def _place_locked_up(self, chunk: KvChunk) -> None:
        """A memory tier's hit below the first: into the first (under the lock; what it
        pushes out stays among the memory tiers or is dropped past them)."""
        pending = [chunk]
        for index in range(self._num_locked):
            pending = self._put(index, pending)

    def clear(self) -> None:
        """Forgets every chunk of every tier (the disk directory's files included)."""
        with self._lock:
            self._spilling.clear()
            for tier in self.tiers[:self._num_locked]:
                tier.clear()
        for tier in self.tiers[self._num_locked:]:
            tier.clear()

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                chunk_tokens=self.chunk_tokens,
                num_hit_tokens=self._num_hit_tokens,
                num_miss_tokens=self._num_miss_tokens,
                num_stored_chunks=self._num_stored_chunks,
                num_stored_tokens=self._num_stored_tokens,
                num_stored_bytes=self._num_stored_bytes,
                num_skipped_tokens=self._num_skipped_tokens,
                num_loaded_chunks=self._num_loaded_chunks,
                num_loaded_tokens=self._num_loaded_tokens,
                num_loaded_bytes=self._num_loaded_bytes,
                num_load_miss_tokens=self._num_load_miss_tokens,
                tiers=tuple(tier.stats() for tier in self.tiers))

    def _tier_get(self, tier: StoreTier, key: ChunkKey) -> KvChunk | None:
        """`tier.get`, under the lock unless the tier locks itself."""
        if tier.locks_itself:
            return tier.get(key)
        with self._lock:
            return tier.get(key)

    def close(self) -> None:
        """Writes every chunk down (see the module docstring), then closes the tiers."""
        for index, tier in enumerate(self.tiers[:-1]):
            below = self.tiers[index + 1]
            with self._lock:                     # oldest first: the LRU order carries over
                keys = [key for key in tier.keys() if not below.contains(key)]
            for key in keys:
                chunk = self._tier_get(tier, key)
                if chunk is not None:
                    self._place(chunk, first=index + 1)
        for tier in self.tiers:
            tier.close()
