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

Thread-safe (`locks_itself`): `_index_lock` covers the index and byte counts only; files are
read, checked, written and deleted outside it, so a slow disk delays only the save or load
that touches it, never a lookup (issue 24). A file being written has its bytes reserved in the
budget and enters the index once renamed into place. `delay_s` (tests only) sleeps that long
per chunk read or written: a slow disk.
"""

import fcntl
import hashlib
import logging
import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import msgspec

from kvcache_svc.kv_store.tier import StoreTier, TierStats
from services.kv_chunks import KvChunk, chunk_problem, range_header, root_checksum
from services.kv_store_wire import ChunkHeader, ChunkKey

log = logging.getLogger(__name__)

MAGIC = b"SSKVCH03"       # 03: BLAKE3 checksums per layer (services.kv_chunks)
OLD_MAGICS = {b"SSKVCH01": "BLAKE2b checksums",     # earlier formats: dropped at start
              b"SSKVCH02": "whole-chunk checksums"}
PREFIX = struct.Struct("<8sI")          # magic, header length
MAX_HEADER_BYTES = 64 << 10
SUFFIX = ".kvchunk"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"


class ChunkFileError(ValueError):
    """A chunk file that is not what its name and header promise."""


class OldFormatError(ChunkFileError):
    """A chunk file an earlier version wrote: dropped, counted in one line at start."""


class DiskTier(StoreTier):
    name = "disk"
    locks_itself = True

    def __init__(self, directory: Path, capacity_bytes: int, delay_s: float = 0.0) -> None:
        """Opens (creating it if need be) and indexes `directory`; raises OSError when it cannot
        be used, or when another process holds it."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.delay_s = delay_s
        self._index_lock = threading.Lock()
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
        return hashlib.blake2b(msgspec.msgpack.encode(key), digest_size=20).hexdigest() + SUFFIX

    def _path(self, key: ChunkKey) -> Path:
        return self.directory / self.file_name(key)

    def _scan(self) -> None:
        found: list[tuple[int, ChunkKey, int]] = []     # (mtime, key, file bytes)
        old_format: dict[str, int] = {}
        for path in self.directory.iterdir():
            if path.name.endswith(TMP_SUFFIX):          # a write cut short by a crash
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                try:
                    found.append(self._index_entry(path))
                except OldFormatError as exc:
                    old_format[str(exc)] = old_format.get(str(exc), 0) + 1
                    path.unlink(missing_ok=True)
                except (OSError, ChunkFileError) as exc:
                    self._drop(path, f"at start: {exc}")
        for why, count in old_format.items():
            log.warning("KV store disk tier %s: dropped %d chunk files of %s", self.directory,
                        count, why)
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
        if magic in OLD_MAGICS:
            raise OldFormatError(f"an earlier format ({OLD_MAGICS[magic]})")
        if magic != MAGIC:
            raise ChunkFileError("not a chunk file (bad magic)")
        offset = PREFIX.size + header_len
        if header_len > MAX_HEADER_BYTES or len(raw) < offset:
            raise ChunkFileError(f"header of {header_len} bytes is too long or cut short")
        try:
            header = msgspec.msgpack.decode(memoryview(raw)[PREFIX.size:offset],
                                            type=ChunkHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ChunkFileError(f"bad header: {exc}") from exc
        return header, offset

    def _read(self, key: ChunkKey) -> KvChunk | None:
        """The file's chunk, fully checked (outside the index lock); a damaged file is
        deleted and counted. A file deleted meanwhile (evicted, removed) is just a miss."""
        path = self._path(key)
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            raw = path.read_bytes()
            header, offset = self._parse_header(raw)
            if header.key != key:
                raise ChunkFileError("holds another key")
            data = memoryview(raw)[offset:]
            if (problem := chunk_problem(header, data)) is not None:
                raise ChunkFileError(problem)
        except (OSError, ChunkFileError) as exc:
            self._damaged(key, path, exc)
            return None
        return KvChunk(header, data)

    def _read_layers(self, key: ChunkKey, start: int, end: int) -> KvChunk | None:
        """Layers [start, end) of the file's chunk: its header, then only the range's bytes,
        checked against the range's checksums (a layer-wise load reads each byte once). A
        damaged file is deleted and counted, as by `_read`."""
        path = self._path(key)
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            with path.open("rb") as file:
                header, offset = self._parse_header(file.read(PREFIX.size + MAX_HEADER_BYTES))
                if header.key != key:
                    raise ChunkFileError("holds another key")
                if not 0 <= start < end <= header.shape[0]:
                    return None
                part = range_header(header, start, end)
                if part is None or root_checksum(header.slice_checksums) != header.checksum:
                    raise ChunkFileError("checksum mismatch")
                file.seek(offset + start * (header.num_bytes // header.shape[0]))
                data = file.read(part.num_bytes)
            if (problem := chunk_problem(part, data)) is not None:
                raise ChunkFileError(problem)
        except (OSError, ChunkFileError) as exc:
            self._damaged(key, path, exc)
            return None
        return KvChunk(part, data)

    def _damaged(self, key: ChunkKey, path: Path, exc: Exception) -> None:
        """A read failed: the file is deleted and counted, unless it already left the index
        (evicted or removed meanwhile: just a miss)."""
        with self._index_lock:
            held = self._forget(key)
        if held:
            self._drop(path, str(exc))

    def _drop(self, path: Path, why: str) -> None:
        log.warning("dropping KV chunk file %s: %s", path.name, why)
        with self._index_lock:
            self.num_dropped_chunks += 1
        path.unlink(missing_ok=True)

    def _forget(self, key: ChunkKey) -> bool:
        """Under the index lock: out of the index; False when it was not in it."""
        file_bytes = self._files.pop(key, None)
        if file_bytes is None:
            return False
        self.num_bytes -= file_bytes
        return True

    def contains(self, key: ChunkKey) -> bool:
        with self._index_lock:
            return key in self._files

    def keys(self) -> list[ChunkKey]:
        with self._index_lock:
            return list(self._files)

    def get(self, key: ChunkKey) -> KvChunk | None:
        if not self.contains(key):
            return None
        chunk = self._read(key)
        if chunk is not None:
            with self._index_lock:
                if key in self._files:
                    self._files.move_to_end(key)
            self._touch(key)
        return chunk

    def held_bytes(self, key: ChunkKey) -> int | None:
        with self._index_lock:
            return self._files.get(key)        # the file's bytes, header included

    def get_layers(self, key: ChunkKey, start: int, end: int) -> KvChunk | None:
        if not self.contains(key):
            return None
        chunk = self._read_layers(key, start, end)
        if chunk is not None:
            with self._index_lock:
                if key in self._files:
                    self._files.move_to_end(key)
        return chunk

    def _touch(self, key: ChunkKey) -> None:
        try:
            os.utime(self._path(key))       # the LRU order of the next start
        except OSError:
            pass

    def put(self, chunk: KvChunk, want_evicted: bool) -> list[KvChunk]:
        header = msgspec.msgpack.encode(chunk.header)
        file_bytes = PREFIX.size + len(header) + chunk.num_bytes
        with self._index_lock:
            if chunk.key in self._files:
                self._files.move_to_end(chunk.key)
                held = True
            else:
                held = False
                if file_bytes > self.capacity_bytes:
                    return [chunk]
                victims = self._take_victims(self.capacity_bytes - file_bytes)
                self.num_bytes += file_bytes            # reserved while the file is written
        if held:
            self._touch(chunk.key)
            return []
        evicted = self._delete(victims, want_evicted)
        written = self._write(chunk, header)
        with self._index_lock:
            self.num_bytes -= file_bytes
            if written and chunk.key not in self._files:
                self._files[chunk.key] = file_bytes
                self.num_bytes += file_bytes
        if not written:
            return [*evicted, chunk] if want_evicted else evicted
        return evicted

    def _write(self, chunk: KvChunk, header: bytes) -> bool:
        if self.delay_s:
            time.sleep(self.delay_s)
        path = self._path(chunk.key)
        try:
            fd, tmp_name = tempfile.mkstemp(dir=self.directory, prefix=".", suffix=TMP_SUFFIX)
        except OSError as exc:
            log.warning("KV chunk not written to %s: %s", self.directory, exc)
            return False
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(PREFIX.pack(MAGIC, len(header)))
                file.write(header)
                file.write(chunk.data)
            os.replace(tmp_name, path)
        except OSError as exc:
            log.warning("KV chunk not written to %s: %s", self.directory, exc)
            Path(tmp_name).unlink(missing_ok=True)
            return False
        return True

    def _take_victims(self, max_bytes: int) -> list[ChunkKey]:
        """Under the index lock: least recently used keys out of the index until at most
        `max_bytes` are used; their files are deleted by `_delete`, outside the lock."""
        victims: list[ChunkKey] = []
        while self._files and self.num_bytes > max_bytes:
            key = next(iter(self._files))
            self._forget(key)
            self.num_evicted_chunks += 1
            victims.append(key)
        return victims

    def _delete(self, victims: list[ChunkKey], want_evicted: bool) -> list[KvChunk]:
        """Deletes the victims' files, read back first when `want_evicted`."""
        evicted: list[KvChunk] = []
        for key in victims:
            path = self._path(key)
            if want_evicted:
                try:
                    raw = path.read_bytes()
                    header, offset = self._parse_header(raw)
                    data = memoryview(raw)[offset:]
                    if header.key == key and chunk_problem(header, data) is None:
                        evicted.append(KvChunk(header, data))
                except (OSError, ChunkFileError):
                    pass
            path.unlink(missing_ok=True)
        return evicted

    def _evict(self, max_bytes: int, want_evicted: bool) -> list[KvChunk]:
        """Deletes least recently used files until at most `max_bytes` are used."""
        with self._index_lock:
            victims = self._take_victims(max_bytes)
        return self._delete(victims, want_evicted)

    def remove(self, key: ChunkKey) -> bool:
        with self._index_lock:
            if not self._forget(key):
                return False
        self._path(key).unlink(missing_ok=True)
        return True

    def clear(self) -> int:
        with self._index_lock:
            keys = list(self._files)
            self._files.clear()
            self.num_bytes = 0
        for key in keys:
            self._path(key).unlink(missing_ok=True)
        return len(keys)

    def stats(self) -> TierStats:
        with self._index_lock:
            return TierStats(self.name, self.capacity_bytes, len(self._files), self.num_bytes,
                             self.num_evicted_chunks, self.num_dropped_chunks)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)         # releases the lock
            self._lock_fd = -1
