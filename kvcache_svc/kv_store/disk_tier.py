"""Disk tier of the KV store: one file per chunk in a directory, under a byte budget, LRU.

The directory outlives kvcache_svc: a new `DiskTier` rebuilds its index by reading every file's
header (oldest access first, so the LRU order survives a restart). A file is

    MAGIC (8 bytes) | header length (u32, little endian) | ChunkHeader (msgpack) | data

named by a hash of its key. Writes go to a temporary file renamed into place, so a reader sees
a whole file or none; without fsync a crash can still leave a short or damaged file, which the
size check (at start) or the checksum (on every read) catches: the file is deleted and counted,
and the caller sees a miss. Headers on disk carry no cluster-token tag (a restart may bring a
new token); the directory is trusted as much as this process's memory, the data is not: every
read is checked against the header's checksum. One kvcache_svc per directory (a lock file).
"""

import fcntl
import hashlib
import logging
import os
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

import msgspec

from kvcache_svc.kv_store.tier import StoreTier, TierStats
from services.kv_chunks import KvChunk, chunk_problem
from services.kv_store_wire import ChunkHeader, ChunkKey

log = logging.getLogger(__name__)

MAGIC = b"SSKVCH01"
PREFIX = struct.Struct("<8sI")          # magic, header length
MAX_HEADER_BYTES = 64 << 10
SUFFIX = ".kvchunk"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"


class ChunkFileError(ValueError):
    """A chunk file that is not what its name and header promise."""


class DiskTier(StoreTier):
    name = "disk"

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        """Opens (creating it if need be) and indexes `directory`; raises OSError when it cannot
        be used, or when another process holds it."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ChunkHeader)
        self._files: OrderedDict[ChunkKey, int] = OrderedDict()  # file bytes, oldest first
        self.num_bytes = 0
        self.num_evicted_chunks = 0
        self.num_dropped_chunks = 0
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise OSError(f"KV store directory {directory} is in use by another "
                          f"process: {exc}") from exc
        self._scan()

    def file_name(self, key: ChunkKey) -> str:
        return hashlib.blake2b(self._encoder.encode(key), digest_size=20).hexdigest() + SUFFIX

    def _path(self, key: ChunkKey) -> Path:
        return self.directory / self.file_name(key)

    def _scan(self) -> None:
        found: list[tuple[int, ChunkKey, int]] = []     # (mtime, key, file bytes)
        for path in self.directory.iterdir():
            if path.name.endswith(TMP_SUFFIX):          # a write cut short by a crash
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                try:
                    found.append(self._index_entry(path))
                except (OSError, ChunkFileError) as exc:
                    self._drop(path, f"at start: {exc}")
        found.sort(key=lambda entry: entry[0])
        for _, key, file_bytes in found:
            self._files[key] = file_bytes
            self.num_bytes += file_bytes
        self._evict(self.capacity_bytes, want_evicted=False)   # the budget may have shrunk
        log.info("KV store disk tier %s: %d chunks, %d bytes", self.directory,
                 len(self._files), self.num_bytes)

    def _index_entry(self, path: Path) -> tuple[int, ChunkKey, int]:
        """A file's key, checked by its header, name and size only (not its checksum)."""
        stat = path.stat()
        with path.open("rb") as file:
            header, offset = self._parse_header(file.read(PREFIX.size + MAX_HEADER_BYTES))
        if path.name != self.file_name(header.key):
            raise ChunkFileError("its name is not its key's")
        if stat.st_size != offset + header.num_bytes:
            raise ChunkFileError(f"{stat.st_size} bytes, header says "
                                 f"{offset + header.num_bytes} (truncated?)")
        return stat.st_mtime_ns, header.key, stat.st_size

    def _parse_header(self, raw: bytes | memoryview) -> tuple[ChunkHeader, int]:
        """The header at the start of a file's bytes, and where its data starts."""
        if len(raw) < PREFIX.size:
            raise ChunkFileError(f"only {len(raw)} bytes")
        magic, header_len = PREFIX.unpack_from(raw)
        if magic != MAGIC:
            raise ChunkFileError("not a chunk file (bad magic)")
        offset = PREFIX.size + header_len
        if header_len > MAX_HEADER_BYTES or len(raw) < offset:
            raise ChunkFileError(f"header of {header_len} bytes is too long or cut short")
        try:
            header = self._decoder.decode(memoryview(raw)[PREFIX.size:offset])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ChunkFileError(f"bad header: {exc}") from exc
        return header, offset

    def _read(self, key: ChunkKey) -> KvChunk | None:
        """The file's chunk, fully checked; a damaged file is deleted and counted."""
        path = self._path(key)
        try:
            raw = path.read_bytes()
            header, offset = self._parse_header(raw)
            if header.key != key:
                raise ChunkFileError("holds another key")
            data = memoryview(raw)[offset:]
            if (problem := chunk_problem(header, data)) is not None:
                raise ChunkFileError(problem)
        except (OSError, ChunkFileError) as exc:
            self._forget(key)
            self._drop(path, str(exc))
            return None
        return KvChunk(header, data)

    def _drop(self, path: Path, why: str) -> None:
        log.warning("dropping KV chunk file %s: %s", path.name, why)
        self.num_dropped_chunks += 1
        path.unlink(missing_ok=True)

    def _forget(self, key: ChunkKey) -> None:
        file_bytes = self._files.pop(key, None)
        if file_bytes is not None:
            self.num_bytes -= file_bytes

    def contains(self, key: ChunkKey) -> bool:
        return key in self._files

    def keys(self) -> list[ChunkKey]:
        return list(self._files)

    def get(self, key: ChunkKey) -> KvChunk | None:
        if key not in self._files:
            return None
        chunk = self._read(key)
        if chunk is not None:
            self._touch(key)
        return chunk

    def _touch(self, key: ChunkKey) -> None:
        self._files.move_to_end(key)
        try:
            os.utime(self._path(key))       # the LRU order of the next start
        except OSError:
            pass

    def put(self, chunk: KvChunk, want_evicted: bool) -> list[KvChunk]:
        if chunk.key in self._files:
            self._touch(chunk.key)
            return []
        header = self._encoder.encode(chunk.header)
        file_bytes = PREFIX.size + len(header) + chunk.num_bytes
        if file_bytes > self.capacity_bytes:
            return [chunk]
        evicted = self._evict(self.capacity_bytes - file_bytes, want_evicted)
        path = self._path(chunk.key)
        fd, tmp_name = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(PREFIX.pack(MAGIC, len(header)))
                file.write(header)
                file.write(chunk.data)
            os.replace(tmp_name, path)
        except OSError as exc:
            log.warning("KV chunk not written to %s: %s", self.directory, exc)
            Path(tmp_name).unlink(missing_ok=True)
            return [*evicted, chunk] if want_evicted else evicted
        self._files[chunk.key] = file_bytes
        self.num_bytes += file_bytes
        return evicted

    def _evict(self, max_bytes: int, want_evicted: bool) -> list[KvChunk]:
        """Deletes least recently used files until at most `max_bytes` are used."""
        evicted: list[KvChunk] = []
        while self._files and self.num_bytes > max_bytes:
            key = next(iter(self._files))
            if want_evicted and (chunk := self._read(key)) is not None:
                evicted.append(chunk)
            if key in self._files:          # _read forgets a damaged file itself
                self._forget(key)
                self._path(key).unlink(missing_ok=True)
                self.num_evicted_chunks += 1
        return evicted

    def remove(self, key: ChunkKey) -> bool:
        if key not in self._files:
            return False
        self._forget(key)
        self._path(key).unlink(missing_ok=True)
        return True

    def clear(self) -> int:
        keys = list(self._files)
        for key in keys:
            self.remove(key)
        return len(keys)

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, len(self._files), self.num_bytes,
                         self.num_evicted_chunks, self.num_dropped_chunks)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)         # releases the lock
            self._lock_fd = -1
