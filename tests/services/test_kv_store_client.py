"""KvStoreClient against a real store socket (TCP): lookups, incremental saves, loads checked
on arrival, and timeouts that come back as misses and reconnect."""

import logging
import socket
import threading
from collections.abc import Iterator

import pytest
import zmq

from kvcache_svc.kv_store import server as store_server
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.kv_chunks import KvChunk, log_stored, skip_leading_tokens
from services.kv_store_client import KvStoreClient, SaveResult
from services.kv_store_wire import LoadReply, StoreInfo
from services.zmq_gate import guard_listener
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, chunk, key
from tests.kvcache_svc.kv_store.serving import HOST, client_codec, server_codec, serving


@pytest.fixture
def store() -> KvStore:
    return KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)


@pytest.fixture
def client(ctx: zmq.Context, store: KvStore) -> Iterator[KvStoreClient]:
    with serving(ctx, store) as loop:
        rpc = KvStoreClient(ctx, loop.address, timeout_ms=5000, codec=client_codec())
        yield rpc
        rpc.close()


def test_describe(client: KvStoreClient) -> None:
    assert client.describe() == StoreInfo(CHUNK_TOKENS)


def test_lookup_returns_the_leading_prefix_held(client: KvStoreClient) -> None:
    assert client.save([chunk(0), chunk(1), chunk(3)]) == SaveResult(3, 0, 0)
    assert client.lookup([key(i) for i in range(5)]) == 2
    assert client.lookup([key(2), key(3)]) == 0
    assert client.lookup([]) == 0
    assert client.lookup_many([[key(0)], [key(3)], [key(1), key(0)]]) == [1, 1, 2]


def test_a_longer_request_saves_only_what_is_not_stored(
        client: KvStoreClient, store: KvStore, caplog: pytest.LogCaptureFixture) -> None:
    # Chunks 0..3 were saved by an earlier request; this one holds chunks 0..5.
    assert client.save([chunk(i) for i in range(4)]) == SaveResult(4, 0, 0)
    keys = [key(i) for i in range(6)]
    num_held = client.lookup(keys)
    skip = skip_leading_tokens(keys, num_held)
    assert (num_held, skip) == (4, 4 * CHUNK_TOKENS)
    result = client.save([chunk(i) for i in range(num_held, 6)])
    assert result == SaveResult(num_stored_chunks=2, num_held_chunks=0, num_failed_chunks=0)
    with caplog.at_level(logging.INFO):
        log_stored(logging.getLogger("worker_svc"), 2 * CHUNK_TOKENS, 6 * CHUNK_TOKENS, skip)
    assert "stored KV for 32 of 96 tokens (skip_leading_tokens=64)" in caplog.text
    stats = store.stats()
    assert stats.num_stored_tokens == 6 * CHUNK_TOKENS and stats.num_skipped_tokens == 0
    assert stats.num_stored_bytes == 6 * 1024
    # A saver's lookup is no admission: the hit and miss counters stay as they were.
    assert stats.num_hit_tokens == stats.num_miss_tokens == 0


def test_load_returns_checked_chunks_and_marks_misses(client: KvStoreClient) -> None:
    client.save([chunk(0), chunk(2)])
    loaded = client.load([key(0), key(1), key(2)])
    assert loaded[1] is None
    for i in (0, 2):
        found = loaded[i]
        assert isinstance(found, KvChunk) and found.header == chunk(i).header
        assert bytes(found.data) == bytes(chunk(i).data)
    assert client.load([]) == []


def test_a_load_split_by_the_data_limit_is_asked_again(
        client: KvStoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_server, "MAX_STORE_DATA_BYTES", 2 * 1024)
    client.save([chunk(i) for i in range(5)])
    loaded = client.load([key(i) for i in range(5)])
    assert [bytes(c.data) if c else None for c in loaded] == [bytes(chunk(i).data)
                                                            for i in range(5)]


def test_a_refused_save_counts_as_failed_and_does_not_raise(client: KvStoreClient,
                                                            store: KvStore) -> None:
    good = chunk(0)
    damaged = KvChunk(good.header, bytes(good.data)[:-1] + b"\x00")
    assert client.save([damaged]) == SaveResult(0, 0, 1)
    assert store.lookup([key(0)]) == 0
    assert client.save([good]) == SaveResult(1, 0, 0)             # the client goes on


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def test_a_timeout_is_a_miss_and_the_client_reconnects(ctx: zmq.Context,
                                                       store: KvStore) -> None:
    port = free_port()                           # nobody listens there yet
    client = KvStoreClient(ctx, f"tcp://{HOST}:{port}", timeout_ms=200, codec=client_codec())
    try:
        assert client.lookup([key(0)]) == 0
        assert client.load([key(0), key(1)]) == [None, None]
        assert client.save([chunk(0), chunk(1)]) == SaveResult(0, 0, 2)
        assert client.describe() is None
        store.put(chunk(0).header, chunk(0).data)
        with serving(ctx, store, port=port):     # the store (re)starts on that port
            # The client reconnects by itself (ZMQ retries every 100 ms, then the handshake):
            # on a loaded machine that may take longer than one 200 ms timeout, each of which
            # is a miss, so a few lookups may miss before one finds the chunk.
            hits = [client.lookup([key(0)]) for _ in range(10)]
            assert 1 in hits and set(hits) <= {0, 1}, hits
            found = client.load([key(0)])[0]
            assert found is not None and bytes(found.data) == bytes(chunk(0).data)
    finally:
        client.close()


def fake_store_reply(ctx: zmq.Context, frames: list[bytes]) -> list[KvChunk | None]:
    """What the client makes of a load of keys 0 and 1 that a fake store answers with
    `frames`."""
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    guard_listener(ctx, fake, server_codec().key)   # the client proves membership first
    port = fake.bind_to_random_port(f"tcp://{HOST}")

    def answer() -> None:
        if fake.poll(2000):
            peer = fake.recv_multipart()[0]
            fake.send_multipart([peer, *frames])

    thread = threading.Thread(target=answer)
    thread.start()
    client = KvStoreClient(ctx, f"tcp://{HOST}:{port}", timeout_ms=1000, codec=client_codec())
    try:
        return client.load([key(0), key(1)])
    finally:
        thread.join()
        client.close()
        fake.close(linger=0)


def test_a_loaded_chunk_that_does_not_check_out_is_a_miss(ctx: zmq.Context) -> None:
    good0, good1 = chunk(0), chunk(1)
    encode = server_codec().encode
    header = encode(LoadReply([good0.header, good1.header]))
    assert [c is not None for c in fake_store_reply(
        ctx, [header, bytes(good0.data), bytes(good1.data)])] == [True, True]
    flipped = bytearray(good1.data)
    flipped[0] ^= 1
    assert [c is not None for c in fake_store_reply(
        ctx, [header, bytes(good0.data), bytes(flipped)])] == [True, False]
    swapped = encode(LoadReply([good1.header, good0.header]))   # another key's chunk
    assert fake_store_reply(ctx, [swapped, bytes(good1.data), bytes(good0.data)]) == [
        None, None]
    assert fake_store_reply(ctx, [header, bytes(good0.data)]) == [None, None]  # a frame short
    truncated = bytes(good1.data)[:len(good1.data) // 2]     # a data frame cut short
    assert [c is not None for c in fake_store_reply(
        ctx, [header, bytes(good0.data), truncated])] == [True, False]


def test_a_chunk_too_large_for_the_store_counts_as_failed(client: KvStoreClient) -> None:
    assert client.save([chunk(0), chunk(1, num_elements=1 << 20)]) == SaveResult(1, 0, 1)
