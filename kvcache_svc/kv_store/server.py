"""The KV store's edge: a ZMQ ROUTER that turns multipart requests into `KvStore` calls.

A request is [identity, header, data...]: the header goes through the Codec (HMAC checked,
types and bounds validated); data frames are raw bytes, one per ChunkHeader of a SaveChunks,
none for any other request. Nothing is believed before it is checked: the number of data frames
against the header, each frame's size and checksum against its ChunkHeader (`KvStore.check`).
A bad request changes nothing and is answered `StoreRefused` (its sender need not wait out a
timeout) and logged; the loop serves on. A reply is [identity, header, data...] the same way,
data frames sent without a copy.

Frames above MAX_CHUNK_BYTES are refused by libzmq itself (ZMQ_MAXMSGSIZE), which drops the
peer before buffering them. `StoreRequestHandler` holds the protocol and needs no socket;
`KvStoreLoop` owns the socket and its thread. Started by `kvcache_svc.server.KvCacheServer`.
"""

import logging
import threading
from collections.abc import Callable, Sequence

import zmq

from kvcache_svc.kv_store.store import ChunkRejected, KvStore
from services import cluster_token
from services.codec import Codec, DecodeError
from services.kv_store_wire import (
    MAX_CHUNK_BYTES,
    MAX_STORE_DATA_BYTES,
    MAX_STORE_HEADER_BYTES,
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
from services.zmq_gate import guard_listener

log = logging.getLogger(__name__)

POLL_MS = 100           # how often the loop looks for a stop request
MAX_ERROR_LEN = 4096    # wire limit of StoreRefused.error

Frames = list[bytes | memoryview]


def store_codec() -> Codec[ToKvStore]:
    """The server's codec (the client's decodes FromKvStore with the same frame limit)."""
    return Codec(ToKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES)


def max_inbound_frame(codec: Codec[ToKvStore]) -> int:
    """ZMQ_MAXMSGSIZE of a store socket: libzmq checks it frame by frame."""
    tag = 0 if codec.key is None else cluster_token.TAG_BYTES
    return max(MAX_CHUNK_BYTES, codec.max_frame_bytes + tag)


class StoreRequestHandler:
    """One request's frames (identity stripped) in, the reply's frames out. Never raises."""

    def __init__(self, store: KvStore, codec: Codec[ToKvStore] | None = None) -> None:
        self.store = store
        self.codec = codec if codec is not None else store_codec()

    def handle(self, frames: Sequence[bytes | memoryview]) -> Frames:
        if not frames:
            return self._refuse("no header frame")
        try:
            message = self.codec.decode(frames[0])
        except DecodeError as exc:
            return self._refuse(f"undecodable request header ({len(frames[0])} bytes): {exc}")
        data = frames[1:]
        try:
            if isinstance(message, SaveChunks):
                return self._save(message, data)
            if data:
                return self._refuse(f"{type(message).__name__} takes no data frames, got "
                                    f"{len(data)}")
            if isinstance(message, LookupChunks):
                # A saver's check of what it need not send: not an admission's hit or miss.
                counts = self.store.lookup_many(message.key_lists, record=False)
                return self._reply(LookupReply(counts))
            if isinstance(message, LoadChunks):
                return self._load(message)
            assert isinstance(message, DescribeStore)
            return self._reply(StoreInfo(self.store.chunk_tokens))
        except Exception as exc:
            log.exception("KV store failed to handle %s", type(message).__name__)
            return self._refuse(f"internal error: {type(exc).__name__}: {exc}")

    def _save(self, message: SaveChunks, data: Sequence[bytes | memoryview]) -> Frames:
        if len(data) != len(message.chunks):
            return self._refuse(f"SaveChunks announces {len(message.chunks)} data frames, "
                                f"got {len(data)}")
        try:
            num_stored, num_held = self.store.save(list(zip(message.chunks, data)))
        except ChunkRejected as exc:
            return self._refuse(f"SaveChunks refused: {exc}")
        return self._reply(SaveReply(num_stored, num_held))

    def _load(self, message: LoadChunks) -> Frames:
        chunks = self.store.load(message.keys, MAX_STORE_DATA_BYTES)
        headers = [None if chunk is None else chunk.header for chunk in chunks]
        return [self.codec.encode(LoadReply(headers)),
                *(chunk.data for chunk in chunks if chunk is not None)]

    def _reply(self, message: FromKvStore) -> Frames:
        return [self.codec.encode(message)]

    def _refuse(self, why: str) -> Frames:
        log.warning("refused a KV store request: %s", why)
        return [self.codec.encode(StoreRefused(why[:MAX_ERROR_LEN]))]


class KvStoreLoop:
    """Serves the store socket on its own thread until stopped. The socket is bound by the
    constructor (a taken port fails there, on the caller's thread) and used only by the loop
    thread afterwards."""

    def __init__(self, ctx: zmq.Context, store: KvStore, host: str, port: int,
                 on_fatal: Callable[[], None], codec: Codec[ToKvStore] | None = None) -> None:
        """Port 0 picks a free port (read it back from `port`). Raises zmq.ZMQError, with
        nothing left open, when the address cannot be bound. `codec`: `store_codec()` unless
        given (tests pass one with their own frame key)."""
        self.handler = StoreRequestHandler(store, codec)
        self.failed = False
        self._on_fatal = on_fatal
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_inbound_frame(self.handler.codec))
        try:
            # Members only, checked at the handshake: a stranger's multipart message of
            # frames under MAXMSGSIZE each is never buffered (services.zmq_gate).
            guard_listener(ctx, self._socket, self.handler.codec.key)
            if port == 0:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            self._socket.close(linger=0)
            raise
        self.port = port
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-store-loop")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop (or, if it never started, just closes the socket)."""
        self._stop.set()
        if self._thread.ident is None:
            self._socket.close(linger=0)
        else:
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._socket.poll(POLL_MS):
                    continue
                identity, *frames = self._socket.recv_multipart(copy=False)
                reply = self.handler.handle([frame.buffer for frame in frames])
                self._socket.send_multipart([identity, *reply], copy=False)
        except Exception:
            # Socket-level failures only (handle never raises): the store cannot go on.
            log.exception("KV store loop failed")
            self.failed = True
            self._on_fatal()
        finally:
            self._socket.close(linger=0)
