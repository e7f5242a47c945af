"""Typed ZMQ endpoints for step traffic: a codec injected, one message per frame.

`Sender` wraps a PUSH socket, `Receiver` a PULL socket, `RequestClient` a DEALER that sends a
request and waits for the matching reply with a timeout (reconnecting after a timeout so a
restarted server is picked up), and `ReplyServer` a ROUTER that answers them. Malformed frames
are logged and dropped by the receiving side; they never raise out of `recv`. Every receiving
socket has ZMQ_MAXMSGSIZE set to the codec's frame limit: libzmq disconnects a peer that sends
more, instead of buffering a frame of any size whole before the codec could refuse it. Every
bound socket admits only the cluster's members at the handshake, and every connecting socket
proves membership there (services.zmq_gate), so a stranger's multipart message is never
buffered at all. Refused frames are logged rate-limited, per peer (services.refusal_log).
"""

import logging
from typing import Generic, TypeVar

import msgspec
import zmq

from services import cluster_token
from services.codec import Codec, DecodeError
from services.refusal_log import RefusalLog
from services.zmq_gate import guard_listener, present_credentials

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def limit_frames(socket: zmq.Socket, codec: Codec) -> None:  # type: ignore[type-arg]
    """Inbound frames above the codec's limit are refused by libzmq (the peer is dropped)."""
    tag = 0 if codec.key is None else cluster_token.TAG_BYTES
    socket.setsockopt(zmq.MAXMSGSIZE, codec.max_frame_bytes + tag)


def peer_of(frame: zmq.Frame) -> str:
    """The sender's address as libzmq knows it ("" where it knows none, e.g. inproc)."""
    try:
        return frame.get("Peer-Address")  # type: ignore[no-any-return]
    except zmq.ZMQError:
        return ""


Socket = zmq.Socket  # type: ignore[type-arg]


def open_socket(ctx: zmq.Context, kind: int, codec: Codec,  # type: ignore[type-arg]
                address: str, bind: bool,
                options: dict[int, int] | None = None) -> tuple[Socket, str]:
    """A socket of `kind` with `options` and the codec's frame limit, bound (a listener:
    members only) or connected (presenting the membership proof) to `address`; port 0 binds
    any free port. Returns it and its address. Raises zmq.ZMQError, with nothing left open,
    when the address cannot be used. Options come first: libzmq applies them to the
    connections made after."""
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():
        socket.setsockopt(option, value)
    limit_frames(socket, codec)
    try:
        if bind:
            guard_listener(ctx, socket, codec.key)
            if address.endswith(":0"):
                host = address.rsplit(":", 1)[0]
                address = f"{host}:{socket.bind_to_random_port(host)}"
            else:
                socket.bind(address)
        else:
            present_credentials(socket, codec.key)
            socket.connect(address)
    except zmq.ZMQError:
        socket.close(linger=0)  # an open socket would hang ctx.term()
        raise
    return socket, address


class Sender:
    """PUSH socket: connects (or binds) and sends encoded wire structs."""

    def __init__(self, ctx: zmq.Context, codec: Codec, address: str, bind: bool = False) -> None:
        self.codec = codec
        self.socket, self.address = open_socket(ctx, zmq.PUSH, codec, address, bind,
                                                {zmq.SNDHWM: 0})

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send(self.codec.encode(message), copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class Receiver(Generic[T]):
    """PULL socket: binds (or connects) and yields decoded, validated messages."""

    def __init__(self, ctx: zmq.Context, codec: Codec[T], address: str, bind: bool = True) -> None:
        self.codec = codec
        self.refusals = RefusalLog(log, f"frames on {address}")
        self.socket, self.address = open_socket(ctx, zmq.PULL, codec, address, bind,
                                                {zmq.RCVHWM: 0})

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
                self.refusals.refused(peer_of(frame), f"malformed frame of "
                                      f"{len(frame.buffer)} bytes: {exc}")

    def close(self) -> None:
        self.socket.close(linger=0)


class RequestClient(Generic[R]):
    """DEALER socket for request/reply with a timeout. One request in flight at a time."""

    def __init__(self, ctx: zmq.Context, codec: Codec[R], address: str) -> None:
        self.ctx = ctx
        self.codec = codec
        self.address = address
        self.refusals = RefusalLog(log, "replies")
        self.socket = self._connect()

    def _connect(self) -> zmq.Socket:
        sock, _ = open_socket(self.ctx, zmq.DEALER, self.codec, self.address, bind=False)
        return sock

    def call(self, message: msgspec.Struct, timeout_ms: int) -> R | None:
        """Sends `message` and returns the decoded reply, or None on timeout (the socket is
        then replaced, so a late reply to this call can never answer the next one)."""
        # A send blocks while the socket has no connection to queue on (one whose handshake
        # the peer refused is dropped): bounded by the same timeout, it counts as no reply.
        self.socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        try:
            self.socket.send(self.codec.encode(message), copy=False)
        except zmq.Again:
            self.refusals.refused(self.address, "no connection to send on (handshake refused?)")
            timeout_ms = 0
        while timeout_ms and self.socket.poll(timeout_ms):
            frame = self.socket.recv(copy=False)
            try:
                return self.codec.decode(frame.buffer)
            except DecodeError as exc:
                self.refusals.refused(self.address, f"malformed reply: {exc}")
        self.socket.close(linger=0)
        self.socket = self._connect()
        return None

    def close(self) -> None:
        self.socket.close(linger=0)


class ReplyServer(Generic[T]):
    """ROUTER socket answering `RequestClient`s; remembers who asked."""

    def __init__(self, ctx: zmq.Context, codec: Codec[T], address: str) -> None:
        self.codec = codec
        self.refusals = RefusalLog(log, f"requests on {address}")
        self.socket, self.address = open_socket(ctx, zmq.ROUTER, codec, address, bind=True)

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes, T] | None:
        """(peer identity, message), or None on timeout. Malformed frames are logged and
        dropped (their sender times out)."""
        while True:
            if timeout_ms is not None and not self.socket.poll(timeout_ms):
                return None
            parts = self.socket.recv_multipart(copy=False)
            if len(parts) != 2:
                self.refusals.refused(peer_of(parts[-1]), f"message with {len(parts)} parts "
                                      f"(expected 2)")
                continue
            try:
                return parts[0].bytes, self.codec.decode(parts[1].buffer)
            except DecodeError as exc:
                self.refusals.refused(peer_of(parts[1]), f"malformed frame of "
                                      f"{len(parts[1].buffer)} bytes: {exc}")

    def reply(self, peer: bytes, message: msgspec.Struct) -> None:
        self.socket.send_multipart([peer, self.codec.encode(message)], copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)
