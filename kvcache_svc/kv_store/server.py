"""The KV store's edge: a ZMQ ROUTER that turns multipart requests into `KvStore` calls.

A request is [identity, header, data...]: the header goes through the Codec (HMAC checked,
types and bounds validated); data frames are raw bytes, one per ChunkHeader of a SaveChunks,
none for any other request. Nothing is believed before it is checked: the number of data frames
against the header, each frame's size and checksum against its ChunkHeader (`KvStore.check`).
A bad request changes nothing and is answered `StoreRefused` (its sender need not wait out a
timeout) and logged through the loop's rate-limited refusal log (services.refusal_log: one line
per peer and interval, as every listener does); the loop serves on. A reply is [identity,
header, data...] the same way, data frames sent without a copy.

Frames above MAX_CHUNK_BYTES are refused by libzmq itself (ZMQ_MAXMSGSIZE), which drops the
peer before buffering them. `StoreRequestHandler` holds the protocol and needs no socket;
`KvStoreLoop` owns the socket and its thread. Started by `kvcache_svc.server.KvCacheServer`.

Loads are never queued behind saves (issue 24): the loop thread only receives, decodes the
header (the codec is the loop's alone) and sends; the work runs on two small thread pools, one
for saves (checksums, extensions, disk writes) and one for everything else (lookups, loads,
describes), and each finished reply wakes the loop through a pipe it polls with the socket. At
most MAX_PENDING_SAVES saves wait or run at once: past that a save is refused at once (the
saver counts it as failed), so a flood of saves cannot hold unbounded memory.
"""

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import zmq

from kvcache_svc.kv_store.store import ChunkRejected, KvStore
from services import cluster_token
from services.channels import peer_of
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
from services.refusal_log import RefusalLog
from services.zmq_gate import guard_listener

log = logging.getLogger(__name__)

POLL_MS = 100           # how often the loop looks for a stop request
MAX_ERROR_LEN = 4096    # wire limit of StoreRefused.error
NUM_SAVE_THREADS = 2
NUM_LOAD_THREADS = 2
MAX_PENDING_SAVES = 8   # saves received and not answered; past this, refused

Frames = list[bytes | memoryview]


def store_codec() -> Codec[ToKvStore]:
    """The server's codec (the client's decodes FromKvStore with the same frame limit)."""
    return Codec(ToKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES)


def max_inbound_frame(codec: Codec[ToKvStore]) -> int:
    """ZMQ_MAXMSGSIZE of a store socket: libzmq checks it frame by frame."""
    tag = 0 if codec.key is None else cluster_token.TAG_BYTES
    return max(MAX_CHUNK_BYTES, codec.max_frame_bytes + tag)


class StoreRequestHandler:
    """One request's frames (identity stripped) in, the reply's frames out. Never raises.
    `decode` and `encode` use the codec (one thread: the loop's); `work` may run on any
    thread (the store is thread-safe)."""

    def __init__(self, store: KvStore, codec: Codec[ToKvStore] | None = None) -> None:
        self.store = store
        self.codec = codec if codec is not None else store_codec()

    def handle(self, frames: Sequence[bytes | memoryview]) -> Frames:
        """decode, work and encode on the caller's thread."""
        decoded = self.decode(frames)
        return self.encode(decoded if isinstance(decoded, Reply) else self.work(*decoded))

    def decode(self, frames: Sequence[bytes | memoryview]
               ) -> "tuple[ToKvStore, Sequence[bytes | memoryview]] | Reply":
        """The request and its data frames, or the refusal to send back."""
        if not frames:
            return self.refuse("no header frame")
        try:
            message = self.codec.decode(frames[0])
        except DecodeError as exc:
            return self.refuse(f"undecodable request header ({len(frames[0])} bytes): {exc}")
        return message, frames[1:]

    def work(self, message: ToKvStore, data: Sequence[bytes | memoryview]) -> "Reply":
        try:
            if isinstance(message, SaveChunks):
                return self._save(message, data)
            if data:
                return self.refuse(f"{type(message).__name__} takes no data frames, got "
                                    f"{len(data)}")
            if isinstance(message, LookupChunks):
                # A saver's check of what it need not send: not an admission's hit or miss.
                counts = self.store.lookup_many(message.key_lists, record=False)
                return Reply(LookupReply(counts))
            if isinstance(message, LoadChunks):
                return self._load(message)
            assert isinstance(message, DescribeStore)
            return Reply(StoreInfo(self.store.chunk_tokens))
        except Exception as exc:
            log.exception("KV store failed to handle %s", type(message).__name__)
            return self.refuse(f"internal error: {type(exc).__name__}: {exc}")

    def encode(self, reply: "Reply") -> Frames:
        return [self.codec.encode(reply.message), *reply.data]

    def _save(self, message: SaveChunks, data: Sequence[bytes | memoryview]) -> "Reply":
        if len(data) != len(message.chunks):
            return self.refuse(f"SaveChunks announces {len(message.chunks)} data frames, "
                                f"got {len(data)}")
        try:
            num_stored, num_held = self.store.save(list(zip(message.chunks, data)))
        except ChunkRejected as exc:
            return self.refuse(f"SaveChunks refused: {exc}")
        return Reply(SaveReply(num_stored, num_held))

    def _load(self, message: LoadChunks) -> "Reply":
        chunks = self.store.load(message.keys, MAX_STORE_DATA_BYTES, message.layers)
        headers = [None if chunk is None else chunk.header for chunk in chunks]
        return Reply(LoadReply(headers), [chunk.data for chunk in chunks if chunk is not None])

    def refuse(self, why: str) -> "Reply":
        """The refusal to send back (logged by the loop, which knows the peer)."""
        return Reply(StoreRefused(why[:MAX_ERROR_LEN]))


class Reply:
    """A reply message and its data frames, before the loop encodes it."""

    __slots__ = ("message", "data")

    def __init__(self, message: FromKvStore, data: Sequence[bytes | memoryview] = ()) -> None:
        self.message = message
        self.data = list(data)


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
        self._saves = ThreadPoolExecutor(NUM_SAVE_THREADS, thread_name_prefix="kv-store-save")
        self._others = ThreadPoolExecutor(NUM_LOAD_THREADS, thread_name_prefix="kv-store-load")
        self._done: queue.SimpleQueue[tuple[bytes | memoryview, str, Reply, bool]] = (
            queue.SimpleQueue())
        self._wake_read, self._wake_write = os.pipe()
        self._num_pending_saves = 0         # the loop thread's own count
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
        self.refusals = RefusalLog(log, f"KV store requests on {self.address}")
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
        self._saves.shutdown(wait=True, cancel_futures=True)
        self._others.shutdown(wait=True, cancel_futures=True)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if self._wake_read in events:
                    os.read(self._wake_read, 4096)
                self._send_done()
                if self._socket in events:
                    self._receive()
        except Exception:
            # Socket-level failures only (handlers never raise): the store cannot go on.
            log.exception("KV store loop failed")
            self.failed = True
            self._on_fatal()
        finally:
            self._socket.close(linger=0)

    def _receive(self) -> None:
        """Every request waiting on the socket, handed to its pool."""
        while self._socket.poll(0):
            identity, *frames = self._socket.recv_multipart(copy=False)
            peer = peer_of(identity)
            decoded = self.handler.decode([frame.buffer for frame in frames])
            if isinstance(decoded, Reply):
                self._send(identity.buffer, peer, decoded)
                continue
            message, data = decoded
            is_save = isinstance(message, SaveChunks)
            if is_save and self._num_pending_saves >= MAX_PENDING_SAVES:
                self._send(identity.buffer, peer, self.handler.refuse(
                    f"busy: {MAX_PENDING_SAVES} saves in flight, try later"))
                continue
            self._num_pending_saves += is_save
            pool = self._saves if is_save else self._others
            pool.submit(self._work, identity.buffer, peer, message, data, is_save)

    def _work(self, identity: bytes | memoryview, peer: str, message: ToKvStore,
              data: Sequence[bytes | memoryview], is_save: bool) -> None:
        """On a pool thread: the reply, queued for the loop, which is woken up."""
        self._done.put((identity, peer, self.handler.work(message, data), is_save))
        try:
            os.write(self._wake_write, b"x")
        except OSError:         # stopped meanwhile
            pass

    def _send_done(self) -> None:
        while True:
            try:
                identity, peer, reply, is_save = self._done.get_nowait()
            except queue.Empty:
                return
            self._num_pending_saves -= is_save
            self._send(identity, peer, reply)

    def _send(self, identity: bytes | memoryview, peer: str, reply: Reply) -> None:
        if isinstance(reply.message, StoreRefused):
            self.refusals.refused(peer, reply.message.error)
        self._socket.send_multipart([identity, *self.handler.encode(reply)], copy=False)
