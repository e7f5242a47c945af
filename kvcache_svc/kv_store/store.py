"""`KvStore`: the KV store's one interface, over a stack of tiers (memory, then disk, ...).

A chunk enters the first tier; what a tier pushes out to make room goes down to the next (a
chunk the last tier pushes out is gone). A hit in a lower tier is copied up into the first.
`close` (kvcache_svc's clean stop) writes every chunk down into the lowest tier that can hold
it, so a restart over the same disk directory finds what the store held, within the disk
budget; after a crash only what had already gone down is there.
Every chunk is checked against its header (sizes, checksum) before it is stored; lower tiers
check again whenever they read (tier.py). Thread-safe: one lock around every tier, so the
store loop and admin calls may share it; checksums are computed before the lock is taken.

Called by `kvcache_svc.kv_store.server` (the store's socket) and, for stats, by the admin API.
"""

import threading
from collections.abc import Sequence

from kvcache_svc.kv_store.tier import StoreTier
from services.kv_chunks import KvChunk, chunk_problem
from services.kv_store_wire import ChunkHeader, ChunkKey, StoreStats


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
        self._lock = threading.Lock()
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
        """`lookup` per key list; `record` False: not counted in the hit and miss tokens."""
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
        return any(tier.contains(key) for tier in self.tiers)

    def check(self, header: ChunkHeader, data: bytes | memoryview) -> KvChunk:
        """The chunk, once `data` matches `header`; raises ChunkRejected otherwise."""
        if header.key.num_tokens > self.chunk_tokens:
            raise ChunkRejected(f"chunk of {header.key.num_tokens} tokens, the store's chunks "
                                f"hold at most {self.chunk_tokens}")
        if (problem := chunk_problem(header, data)) is not None:
            raise ChunkRejected(problem)
        return KvChunk(header, data)

    def save(self, chunks: Sequence[tuple[ChunkHeader, bytes | memoryview]]) -> tuple[int, int]:
        """Stores every chunk not held yet: (number stored, number already held); the two
        add up to fewer than `chunks` when one fit no tier. All or nothing: raises
        ChunkRejected, storing none, when any chunk fails `check`."""
        checked = []
        for index, (header, data) in enumerate(chunks):
            try:
                checked.append(self.check(header, data))
            except ChunkRejected as exc:
                raise ChunkRejected(f"chunk {index}: {exc}") from exc
        num_stored = num_held = 0
        with self._lock:
            for chunk in checked:
                if self._holds(chunk.key):
                    num_held += 1
                    self._num_skipped_tokens += chunk.key.num_tokens
                    continue
                self._place(chunk)
                if not self._holds(chunk.key):      # larger than every tier's budget
                    continue
                num_stored += 1
                self._num_stored_chunks += 1
                self._num_stored_tokens += chunk.key.num_tokens
                self._num_stored_bytes += chunk.num_bytes
        return num_stored, num_held

    def put(self, header: ChunkHeader, data: bytes | memoryview) -> bool:
        """Stores one chunk; False when it was already held. Raises ChunkRejected."""
        return self.save([(header, data)])[0] == 1

    def _place(self, chunk: KvChunk, first: int = 0) -> None:
        """Into tier `first`; whatever each tier pushes out goes to the next."""
        pending = [chunk]
        for index in range(first, len(self.tiers)):
            has_next = index + 1 < len(self.tiers)
            pending = [out for each in pending for out in self.tiers[index].put(each, has_next)]
            if not pending:
                return

    def get(self, key: ChunkKey) -> KvChunk | None:
        """The chunk from the fastest tier holding it (copied up into the first tier when
        found lower); None when no tier holds it, or the one that did found it damaged."""
        return self.load([key], max_bytes=0)[0]

    def load(self, keys: Sequence[ChunkKey], max_bytes: int) -> list[KvChunk | None]:
        """`get` for each of a prefix of `keys`: every key, or those before the one whose
        chunk would take the total past `max_bytes` (the first key is always answered)."""
        answered: list[KvChunk | None] = []
        num_bytes = 0
        with self._lock:
            for key in keys:
                chunk = self._get(key)
                if chunk is not None and answered and num_bytes + chunk.num_bytes > max_bytes:
                    break
                answered.append(chunk)
                if chunk is None:
                    self._num_load_miss_tokens += key.num_tokens
                    continue
                num_bytes += chunk.num_bytes
                self._num_loaded_chunks += 1
                self._num_loaded_tokens += key.num_tokens
                self._num_loaded_bytes += chunk.num_bytes
        return answered

    def _get(self, key: ChunkKey) -> KvChunk | None:
        for index, tier in enumerate(self.tiers):
            chunk = tier.get(key)
            if chunk is not None:
                if index > 0:
                    self._place(chunk)
                return chunk
        return None

    def clear(self) -> None:
        """Forgets every chunk of every tier (the disk directory's files included)."""
        with self._lock:
            for tier in self.tiers:
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

    def close(self) -> None:
        """Writes every chunk down (see the module docstring), then closes the tiers."""
        with self._lock:
            for index, tier in enumerate(self.tiers[:-1]):
                below = self.tiers[index + 1]
                for key in tier.keys():              # oldest first: the LRU order carries over
                    if not below.contains(key) and (chunk := tier.get(key)) is not None:
                        self._place(chunk, first=index + 1)
            for tier in self.tiers:
                tier.close()
