"""The KV events edge of kvcache_svc: a ZMQ PUB socket that sends `KvEventBatch` frames.

`pools.KvCachePools` builds the batches (it owns the epoch and the seq counter, and hands
each batch over under its lock, so batches leave in operation order); this module only binds,
encodes and sends. Bound by `server.KvCacheServer.start`.

Subscribers connect a SUB socket, subscribe to everything (b"") and decode each frame with
`Codec(KvEventBatch)`. Only the cluster's members may subscribe: the PUB socket admits a peer
only if it proves at the handshake that it holds the cluster token
(`services.zmq_gate.present_credentials(sub, frame_key(token))`), so a stranger never sees a
prefix hash and cannot confirm what another client sent by hashing a guessed prompt. A PUB
socket never blocks the sender: a subscriber that is slow, or not connected yet, misses
batches and sees a gap in `seq`.
"""

import logging
import threading

import zmq

from services.channels import tcp_address
from services.codec import Codec
from services.kv_wire import (
    KvEventBatch,
)
from services.zmq_gate import guard_listener

log = logging.getLogger(__name__)


class EventPublisher:
    """PUB socket for KV event batches; `publish` may be called from any thread.

    ZMQ sockets are not thread-safe: the plan loop and admin RPCs both publish, so every use of
    the socket happens under this object's own lock (which also orders `close` after sends).
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        """Binds `host:port`; port 0 picks a free port (read it back from `port`). Raises
        zmq.ZMQError, with nothing left open, when the address cannot be bound."""
        self._codec: Codec[KvEventBatch] = Codec(KvEventBatch)
        self._lock = threading.Lock()
        self._closed = False
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A PUB socket only receives subscriptions: a larger frame is no subscriber of ours.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4096)
        try:
            guard_listener(ctx, self.socket, self._codec.key)
            if port == 0:
                port = self.socket.bind_to_random_port(f"tcp://{host}")
            else:
                self.socket.bind(tcp_address(host, port))
        except zmq.ZMQError:
            self.socket.close(linger=0)
            raise
        self.port = port
        self.address = tcp_address(host, port)

    def publish(self, batch: KvEventBatch) -> None:
        """Sends one batch to every connected subscriber. Never raises: the state change it
        reports has already happened, and a lost batch shows as a seq gap."""
        frame = self._codec.encode(batch)
        with self._lock:
            if self._closed:
                return
            try:
                self.socket.send(frame, flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                log.warning("KV event batch not published: %s", exc)

    def close(self) -> None:
        """Closes the socket; later `publish` calls do nothing."""
        with self._lock:
            self._closed = True
            self.socket.close(linger=0)
