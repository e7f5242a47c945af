"""The store's flags and env fallbacks, and `python -m kvcache_svc` serving the store as a
real process: a disk directory outlives a restart."""

from pathlib import Path

import pytest
import zmq

from kvcache_svc.__main__ import parse_config
from kvcache_svc.kv_store.config import GIB, KvStoreConfig, build_store
from services.codec import Codec
from services.kv_store_client import KvStoreClient, SaveResult
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore
from tests.kvcache_svc.kv_store.common import chunk, key
from tests.kvcache_svc.test_server import KEY, free_port, start_service


def test_the_store_is_on_by_default() -> None:
    assert parse_config([]).store == KvStoreConfig(
        port=50057, chunk_tokens=256, memory_bytes=2 * GIB, disk_dir=None, disk_bytes=16 * GIB)


def test_flags_and_their_env_fallbacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = parse_config(["--kv-store-port", "0", "--kv-chunk-tokens", "512",
                           "--kv-store-memory-gib", "0.5", "--kv-store-dir", str(tmp_path),
                           "--kv-store-disk-gib", "3"]).store
    assert config == KvStoreConfig(0, 512, GIB // 2, tmp_path, 3 * GIB)
    monkeypatch.setenv("SPLITSERVE_KV_STORE_PORT", "6000")
    monkeypatch.setenv("SPLITSERVE_KV_CHUNK_TOKENS", "128")
    monkeypatch.setenv("SPLITSERVE_KV_STORE_MEMORY_GIB", "1")
    monkeypatch.setenv("SPLITSERVE_KV_STORE_DIR", str(tmp_path))
    monkeypatch.setenv("SPLITSERVE_KV_STORE_DISK_GIB", "2")
    assert parse_config([]).store == KvStoreConfig(6000, 128, GIB, tmp_path, 2 * GIB)
    monkeypatch.setenv("SPLITSERVE_KV_NO_STORE", "1")
    assert parse_config([]).store is None
    assert parse_config(["--no-kv-store"]).store is None


@pytest.mark.parametrize("flags", [["--kv-store-port", "70000"], ["--kv-chunk-tokens", "0"],
                                   ["--kv-store-memory-gib", "-1"],
                                   ["--kv-store-disk-gib", "nan"],
                                   ["--kv-store-memory-gib", "inf"]])
def test_bad_values_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(flags)


def test_build_store_layers_memory_then_disk(tmp_path: Path) -> None:
    store = build_store(KvStoreConfig(0, 256, GIB, tmp_path, GIB))
    assert [tier.name for tier in store.tiers] == ["memory", "disk"]
    store.close()
    assert [t.name for t in build_store(KvStoreConfig(0, 256, GIB, None, GIB)).tiers] == [
        "memory"]


def test_the_disk_tier_outlives_a_service_restart(tmp_path: Path) -> None:
    store_port = free_port()
    args = ["--kv-store-dir", str(tmp_path), "--kv-chunk-tokens", "16"]
    ctx = zmq.Context()
    client = KvStoreClient(ctx, f"tcp://127.0.0.1:{store_port}", timeout_ms=5000,
                           codec=Codec(FromKvStore, MAX_STORE_HEADER_BYTES, key=KEY))
    try:
        first = start_service(free_port(), free_port(), store_port=store_port, args=args)
        try:
            assert f"tcp://127.0.0.1:{store_port}" in first.wait_for("KV store on")
            first.wait_for("kvcache_svc ready")
            assert client.save([chunk(i) for i in range(3)]) == SaveResult(3, 0, 0)
        finally:
            assert first.stop() == 0                    # a clean stop writes memory down
        second = start_service(free_port(), free_port(), store_port=store_port, args=args)
        try:
            assert "disk tier" in second.wait_for("3 chunks")
            second.wait_for("kvcache_svc ready")
            assert client.lookup([key(i) for i in range(4)]) == 3
            loaded = client.load([key(1)])[0]
            assert loaded is not None and bytes(loaded.data) == bytes(chunk(1).data)
        finally:
            assert second.stop() == 0
    finally:
        client.close()
        ctx.term()


def test_no_store_no_socket() -> None:
    svc = start_service(free_port(), free_port(), args=["--no-kv-store"])
    try:
        lines: list[str] = []
        while not lines or "kvcache_svc ready" not in lines[-1]:
            lines.append(svc.lines.get(timeout=15))
        assert not any("KV store" in line for line in lines)
    finally:
        assert svc.stop() == 0
