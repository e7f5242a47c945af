"""A KV store served on a real socket, with a frame key as in a cluster, and the codecs of
its peers."""

from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from kvcache_svc.kv_store.server import KvStoreLoop
from kvcache_svc.kv_store.store import KvStore
from services import cluster_token
from services.codec import Codec
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore, ToKvStore

HOST = "127.0.0.1"
TOKEN = "kv-store-test-token-0123456789"
KEY = cluster_token.frame_key(TOKEN)


def server_codec() -> Codec[ToKvStore]:
    return Codec(ToKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES, key=KEY)


def client_codec() -> Codec[FromKvStore]:
    return Codec(FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES, key=KEY)


@contextmanager
def serving(ctx: zmq.Context, store: KvStore, port: int = 0) -> Iterator[KvStoreLoop]:
    loop = KvStoreLoop(ctx, store, HOST, port, on_fatal=lambda: None, codec=server_codec())
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()
        assert not loop.failed
