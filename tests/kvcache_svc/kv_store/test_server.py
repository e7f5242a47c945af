"""The KV store's socket, driven by a raw DEALER over TCP: malformed requests (frames, sizes,
checksums, the cluster-token tag) are refused, change nothing, and serving goes on."""

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvcache_svc.kv_store import server as store_server
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services import cluster_token
from services.codec import Codec
from services.kv_store_wire import (
    MAX_CHUNK_BYTES,
    DescribeStore,
    FromKvStore,
    LoadChunks,
    LoadReply,
    LookupChunks,
    LookupReply,
    SaveChunks,
    SaveReply,
    StoreInfo,
    StoreRefused,
    ToKvStore,
)
from services.zmq_gate import present_credentials
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, chunk, key
from tests.kvcache_svc.kv_store.serving import HOST, KEY, client_codec, server_codec, serving

TIMEOUT_MS = 5000


@pytest.fixture
def store() -> KvStore:
    return KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)


@pytest.fixture
def address(ctx: zmq.Context, store: KvStore) -> Iterator[str]:
    with serving(ctx, store) as loop:
        yield loop.address


@pytest.fixture
def raw(ctx: zmq.Context, address: str) -> Iterator[zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    present_credentials(sock, KEY)   # past the handshake: the frames themselves are tested
    sock.connect(address)
    yield sock
    sock.close(linger=0)


def ask(sock: zmq.Socket, frames: list[bytes]) -> tuple[FromKvStore, list[bytes]]:
    sock.send_multipart(frames)
    assert sock.poll(TIMEOUT_MS), "no answer"
    header, *data = sock.recv_multipart()
    return client_codec().decode(header), data


def encode(message: msgspec.Struct) -> bytes:
    return client_codec().encode(message)


def test_save_lookup_load_describe(raw: zmq.Socket) -> None:
    chunks = [chunk(0), chunk(1)]
    reply, _ = ask(raw, [encode(SaveChunks([c.header for c in chunks])),
                         *(bytes(c.data) for c in chunks)])
    assert reply == SaveReply(num_stored_chunks=2, num_held_chunks=0)
    reply, _ = ask(raw, [encode(LookupChunks([[key(0), key(1), key(2)], [key(1)]]))])
    assert reply == LookupReply([2, 1])
    reply, data = ask(raw, [encode(LoadChunks([key(1), key(5), key(0)]))])
    assert reply == LoadReply([chunks[1].header, None, chunks[0].header])
    assert data == [bytes(chunks[1].data), bytes(chunks[0].data)]
    reply, _ = ask(raw, [encode(DescribeStore())])
    assert reply == StoreInfo(CHUNK_TOKENS)


def bad_requests() -> dict[str, tuple[list[bytes], str]]:
    good = chunk(7)
    header, data = good.header, bytes(good.data)
    flipped = bytearray(data)
    flipped[100] ^= 0x04
    save = encode(SaveChunks([header]))
    return {
        "truncated frame": ([save, data[:-10]], "data of 1014 bytes, header says 1024"),
        "too few frames": ([encode(SaveChunks([header, chunk(8).header])), data],
                           "announces 2 data frames, got 1"),
        "too many frames": ([save, data, data], "announces 1 data frames, got 2"),
        "data for a lookup": ([encode(LookupChunks([[key(7)]])), data],
                              "LookupChunks takes no data frames"),
        "size against shape": ([encode(SaveChunks([msgspec.structs.replace(
            header, shape=(256,))])), data], "header says 1024 bytes, but shape [256]"),
        "bad checksum": ([save, bytes(flipped)], "checksum mismatch"),
        "no token tag": ([Codec(ToKvStore).encode(SaveChunks([header])), data],
                         "without a valid cluster token tag"),
        "another cluster's tag": ([Codec(ToKvStore, key=cluster_token.frame_key(
            "another-cluster-token")).encode(SaveChunks([header])), data],
            "without a valid cluster token tag"),
        "not msgpack": ([server_codec().encode(DescribeStore())[:1] + b"\xc1", data],
                        "undecodable request header"),
        "empty header": ([b""], "undecodable request header"),
    }


@pytest.mark.parametrize("case", list(bad_requests()))
def test_a_bad_request_is_refused_and_serving_goes_on(case: str, raw: zmq.Socket,
                                                      store: KvStore) -> None:
    frames, why = bad_requests()[case]
    reply, data = ask(raw, frames)
    assert isinstance(reply, StoreRefused) and why in reply.error and data == []
    assert store.stats().num_stored_chunks == 0 and store.lookup([key(7)]) == 0
    good = chunk(7)
    reply, _ = ask(raw, [encode(SaveChunks([good.header])), bytes(good.data)])
    assert reply == SaveReply(1, 0)


def test_a_save_is_all_or_nothing(raw: zmq.Socket, store: KvStore) -> None:
    good, bad = chunk(0), chunk(1)
    reply, _ = ask(raw, [encode(SaveChunks([good.header, bad.header])), bytes(good.data),
                         bytes(bad.data)[:-1]])
    assert isinstance(reply, StoreRefused) and "chunk 1:" in reply.error
    assert store.lookup([key(0)]) == 0


def test_a_frame_over_the_limit_drops_the_peer_unread(
        ctx: zmq.Context, store: KvStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_server, "MAX_CHUNK_BYTES", 4096)
    small: Codec[ToKvStore] = Codec(ToKvStore, max_frame_bytes=1024, key=client_codec().key)
    loop = store_server.KvStoreLoop(ctx, store, HOST, 0, lambda: None, codec=small)
    loop.start()
    sender, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (sender, other):
            sock.setsockopt(zmq.LINGER, 0)
            present_credentials(sock, KEY)
            sock.connect(loop.address)
        sender.send_multipart([encode(DescribeStore()), b"x" * 5000])
        assert not sender.poll(300)                      # libzmq dropped it: no reply
        assert ask(other, [encode(DescribeStore())])[0] == StoreInfo(CHUNK_TOKENS)
    finally:
        sender.close(linger=0)
        other.close(linger=0)
        loop.stop()


def test_the_inbound_frame_limit_fits_a_chunk_and_a_header() -> None:
    assert store_server.max_inbound_frame(server_codec()) == MAX_CHUNK_BYTES


def test_a_load_reply_stays_within_the_data_limit(
        raw: zmq.Socket, store: KvStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_server, "MAX_STORE_DATA_BYTES", 2 * 1024)
    for i in range(3):
        store.put(chunk(i).header, chunk(i).data)
    reply, data = ask(raw, [encode(LoadChunks([key(0), key(1), key(2)]))])
    assert isinstance(reply, LoadReply) and len(reply.chunks) == 2 and len(data) == 2
