"""DiskTier: files survive a new tier over the same directory; damaged files are dropped and
counted, never returned; LRU under the byte budget, in the order of last access."""

import logging
import os
import time
from pathlib import Path

import pytest

from kvcache_svc.kv_store.disk_tier import MAGIC, PREFIX, DiskTier
from tests.kvcache_svc.kv_store.common import chunk, key

FILE_BYTES = 1024 + 400      # a 1 KiB chunk's file, header included (a generous bound)


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kvchunk"))


def test_chunks_survive_a_new_tier_over_the_same_directory(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for i in range(3):
        assert tier.put(chunk(i), want_evicted=False) == []
    used = tier.stats().num_bytes
    tier.close()

    again = DiskTier(tmp_path, capacity_bytes=1 << 20)
    stats = again.stats()
    assert (stats.num_chunks, stats.num_bytes) == (3, used)
    for i in range(3):
        found = again.get(key(i))
        assert found is not None and found.header == chunk(i).header
        assert bytes(found.data) == bytes(chunk(i).data)
    assert again.get(key(9)) is None
    again.close()


def test_one_process_per_directory(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    with pytest.raises(OSError, match="in use"):
        DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.close()
    DiskTier(tmp_path, capacity_bytes=1 << 20).close()


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_corrupted_file_is_dropped_and_counted(tmp_path: Path, where: str) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(chunk(0), want_evicted=False)
    tier.put(chunk(1), want_evicted=False)
    path = tmp_path / tier.file_name(key(0))
    flip_byte(path, path.stat().st_size - 7 if where == "data" else PREFIX.size + 5)
    # A flipped data byte passes the start-up scan (sizes only) and fails the checksum on
    # read; a flipped header byte may already fail the scan. Either way: dropped, a miss.
    tier.close()
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert tier.get(key(0)) is None
    assert not path.exists()
    assert tier.stats().num_dropped_chunks == 1 and tier.stats().num_chunks == 1
    assert tier.get(key(1)) is not None                 # the other chunk is untouched
    tier.close()


def test_a_file_corrupted_while_indexed_is_dropped_on_read(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(chunk(0), want_evicted=False)
    path = tmp_path / tier.file_name(key(0))
    flip_byte(path, path.stat().st_size - 1)
    assert tier.contains(key(0))
    assert tier.get(key(0)) is None
    assert not tier.contains(key(0)) and not path.exists()
    assert tier.stats().num_dropped_chunks == 1 and tier.stats().num_bytes == 0
    tier.close()


@pytest.mark.parametrize("keep", [3, PREFIX.size + 10, -1])
def test_a_truncated_file_is_dropped_at_start(tmp_path: Path, keep: int) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(chunk(0), want_evicted=False)
    tier.close()
    path = tmp_path / tier.file_name(key(0))
    path.write_bytes(path.read_bytes()[:keep])
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert not tier.contains(key(0)) and tier.get(key(0)) is None
    assert not path.exists() and tier.stats().num_dropped_chunks == 1
    tier.close()


def test_files_of_earlier_formats_are_dropped_at_start_in_a_line_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Format 01 checksummed with BLAKE2b, 02 whole chunks: their files would fail every
    read's check."""
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for i in range(3):
        tier.put(chunk(i), want_evicted=False)
    tier.close()
    for i, magic in enumerate((b"SSKVCH01", b"SSKVCH02")):   # as earlier versions wrote them
        path = tmp_path / tier.file_name(key(i))
        path.write_bytes(magic + path.read_bytes()[len(MAGIC):])
    with caplog.at_level(logging.WARNING):
        tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert tier.stats().num_chunks == 1 and tier.get(key(2)) is not None
    assert len(files(tmp_path)) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(lines) == sorted(  # one line per earlier format
        f"KV store disk tier {tmp_path}: dropped 1 chunk files of an earlier format ({why})"
        for why in ("BLAKE2b checksums", "whole-chunk checksums")), lines
    tier.close()


def test_a_file_under_another_keys_name_is_dropped(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(chunk(0), want_evicted=False)
    tier.close()
    (tmp_path / tier.file_name(key(0))).rename(tmp_path / tier.file_name(key(5)))
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert tier.stats().num_chunks == 0 and tier.stats().num_dropped_chunks == 1
    tier.close()


def test_leftover_temporary_files_are_removed_and_foreign_files_kept(tmp_path: Path) -> None:
    (tmp_path / ".abc.tmp").write_bytes(b"half a chunk")
    (tmp_path / "notes.txt").write_text("not ours")
    DiskTier(tmp_path, capacity_bytes=1 << 20).close()
    assert not (tmp_path / ".abc.tmp").exists() and (tmp_path / "notes.txt").exists()


def test_lru_eviction_under_the_budget_follows_access_across_restarts(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=3 * FILE_BYTES)
    for i in range(3):
        tier.put(chunk(i), want_evicted=False)
        time.sleep(0.01)                                # distinct mtimes
    assert tier.get(key(0)) is not None                 # 1 is now the least recently used
    tier.close()
    tier = DiskTier(tmp_path, capacity_bytes=3 * FILE_BYTES)
    evicted = tier.put(chunk(3), want_evicted=True)
    assert [c.key for c in evicted] == [key(1)]
    assert bytes(evicted[0].data) == bytes(chunk(1).data)   # read back for a tier below
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    assert len(files(tmp_path)) == 3 and tier.stats().num_evicted_chunks == 1
    tier.close()


def test_a_smaller_budget_at_start_evicts_the_oldest(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for i in range(4):
        tier.put(chunk(i), want_evicted=False)
        os.utime(tmp_path / tier.file_name(key(i)), ns=(i * 10**9, i * 10**9))
    tier.close()
    tier = DiskTier(tmp_path, capacity_bytes=2 * FILE_BYTES)
    assert [tier.contains(key(i)) for i in range(4)] == [False, False, True, True]
    tier.close()


def test_a_chunk_larger_than_the_budget_is_not_written(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1000)
    big = chunk(0)
    assert tier.put(big, want_evicted=True) == [big]
    assert files(tmp_path) == []
    tier.close()


def test_remove_and_clear_delete_the_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for i in range(3):
        tier.put(chunk(i), want_evicted=False)
    assert tier.remove(key(0)) and not tier.remove(key(0))
    assert len(files(tmp_path)) == 2
    assert tier.clear() == 2 and files(tmp_path) == []
    assert tier.stats().num_bytes == 0
    tier.close()
