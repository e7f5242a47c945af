"""Typed ZMQ endpoints for step traffic: a codec injected, one message per frame.

`Sender` wraps a PUSH socket, `Receiver` a PULL socket, `RequestClient` a DEALER that sends a
request and waits for the matching reply with a timeout (reconnecting after a timeout so a
restarted server is picked up), and `ReplyServer` a ROUTER that answers them. Malformed frames
are logged and dropped by the receiving side; they never raise out of `recv`. Every receiving
socket has ZMQ_MAXMSGSIZE set to the codec's frame limit: libzmq disconnects a peer that sends
more, instead of buffering a frame of any size whole before the codec could refuse it.
"""

import logging
from typing import Generic, TypeVar

import msgspec
import zmq

from services import cluster_token
from services.codec import Codec, DecodeError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def limit_frames(socket: zmq.Socket, codec: Codec) -> None:  # type: ignore[type-arg]
    """Inbound frames above the codec's limit are refused by libzmq (the peer is dropped)."""
    tag = 0 if codec.key is None else cluster_token.TAG_BYTES
    socket.setsockopt(zmq.MAXMSGSIZE, codec.max_frame_bytes + tag)


class Sender:
    """PUSH socket: connects (or binds) and sends encoded wire structs."""

    def __init__(self, ctx: zmq.Context, codec: Codec, address: str, bind: bool = False) -> None:
        self.codec = codec
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        try:
            if bind:
                self.socket.bind(address)
            else:
                self.socket.connect(address)
        except zmq.ZMQError:
            self.socket.close(linger=0)  # an open socket would hang ctx.term()
            raise

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send(self.codec.encode(message), copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class Receiver(Generic[T]):
    """PULL socket: binds (or connects) and yields decoded, validated messages."""

    def __init__(self, ctx: zmq.Context, codec: Codec[T], address: str, bind: bool = True) -> None:
        self.codec = codec
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        limit_frames(self.socket, codec)
        try:
            if bind:
                if address.endswith(":0"):
                    port = self.socket.bind_to_random_port(address.rsplit(":", 1)[0])
                    address = f"{address.rsplit(':', 1)[0]}:{port}"
                else:
                    self.socket.bind(address)
            else:
                self.socket.connect(address)
        except zmq.ZMQError:
            self.socket.close(linger=0)
            raise
        self.address = address

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """The next valid message, or None when `timeout_ms` passes first. Invalid frames are
        logged and skipped."""
        while True:
            if timeout_ms is not None and not self.socket.poll(timeout_ms):
                return None
            frame = self.socket.recv(copy=False)
            try:
                return self.codec.decode(frame.buffer)
            except DecodeError as exc:
                log.warning("dropping malformed frame (%d bytes): %s", len(frame.buffer), exc)

    def close(self) -> None:
        self.socket.close(linger=0)


class RequestClient(Generic[R]):
    """DEALER socket for request/reply with a timeout. One request in flight at a time."""

    def __init__(self, ctx: zmq.Context, codec: Codec[R], address: str) -> None:
        self.ctx = ctx
        self.codec = codec
        self.address = address
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        limit_frames(sock, self.codec)
        sock.connect(self.address)
        return sock

    def call(self, message: msgspec.Struct, timeout_ms: int) -> R | None:
        """Sends `message` and returns the decoded reply, or None on timeout (the socket is
        then replaced, so a late reply to this call can never answer the next one)."""
        self.socket.send(self.codec.encode(message), copy=False)
        while self.socket.poll(timeout_ms):
            frame = self.socket.recv(copy=False)
            try:
                return self.codec.decode(frame.buffer)
            except DecodeError as exc:
                log.warning("dropping malformed reply from %s: %s", self.address, exc)
        self.socket.close(linger=0)
        self.socket = self._connect()
        return None

    def close(self) -> None:
        self.socket.close(linger=0)


class ReplyServer(Generic[T]):
    """ROUTER socket answering `RequestClient`s; remembers who asked."""

    def __init__(self, ctx: zmq.Context, codec: Codec[T], address: str) -> None:
        self.codec = codec
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        limit_frames(self.socket, codec)
        try:
            self.socket.bind(address)
        except zmq.ZMQError:
            self.socket.close(linger=0)
            raise

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes, T] | None:
        """(peer identity, message), or None on timeout. Malformed frames are logged and
        dropped (their sender times out)."""
        while True:
            if timeout_ms is not None and not self.socket.poll(timeout_ms):
                return None
            parts = self.socket.recv_multipart(copy=False)
            if len(parts) != 2:
                log.warning("dropping message with %d parts (expected 2)", len(parts))
                continue
            try:
                return parts[0].bytes, self.codec.decode(parts[1].buffer)
            except DecodeError as exc:
                log.warning("dropping malformed frame (%d bytes): %s", len(parts[1].buffer), exc)

    def reply(self, peer: bytes, message: msgspec.Struct) -> None:
        self.socket.send_multipart([peer, self.codec.encode(message)], copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)
