"""The ZMQ handshake admits the cluster's members only: a listener never hands a stranger's
message (of one frame or many) to the application, members still talk, a wrong secret is
logged (rate-limited), and a context with a gate still terminates."""

import logging
import time

import pytest
import zmq

from services.channels import Receiver, ReplyServer, RequestClient, Sender
from services.cluster_token import frame_key
from services.codec import Codec
from services.kv_wire import (
    DropPool,
    FromKvCache,
    ToKvCache,
)
from services.wire import (
    StepInput,
    ToWorker,
)
from services.zmq_gate import guard_listener, present_credentials
from tests.services.refused_peer import queue_while_refused

KEY = frame_key("zmq-gate-test-token-0123456789")
OTHER = frame_key("some-other-cluster-token-9876")


def step() -> StepInput:
    return StepInput(1, [], [], [])


def test_only_members_get_through_the_handshake(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="services.zmq_gate")
    ctx, outside = zmq.Context(), zmq.Context()
    try:
        receiver: Receiver[StepInput] = Receiver(ctx, Codec(ToWorker, key=KEY),
                                                 "tcp://127.0.0.1:0")
        anonymous = outside.socket(zmq.PUSH)
        wrong = outside.socket(zmq.PUSH)
        present_credentials(wrong, OTHER)
        for sock in (anonymous, wrong):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(receiver.address)
            # Queued on the sender's side: the handshake never completes, nothing is sent.
            queue_while_refused(sock, [b"x" * 1024] * 4)
        assert receiver.recv(timeout_ms=500) is None
        member = Sender(outside, Codec(ToWorker, key=KEY), receiver.address)
        member.send(step())
        assert receiver.recv(timeout_ms=2000) == step()
        refused = [r.getMessage() for r in caplog.records]
        assert any("wrong cluster credentials" in line for line in refused), refused
        # The wrong peer keeps reconnecting; its refusals are counted, not each logged.
        time.sleep(0.5)
        assert sum("wrong cluster credentials" in r.getMessage()
                   for r in caplog.records) == 1
        for sock in (anonymous, wrong):
            sock.close(linger=0)
        member.close()
        receiver.close()
    finally:
        outside.destroy(linger=0)
        ctx.destroy(linger=0)      # returns: the gate's thread closes its socket on ETERM


def test_a_strangers_multipart_request_is_never_read() -> None:
    ctx = zmq.Context()
    try:
        server: ReplyServer[ToKvCache] = ReplyServer(ctx, Codec(ToKvCache, key=KEY),
                                                     "tcp://127.0.0.1:0")
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(server.address)
        # Queued on the stranger's side for good: the handshake never completes.
        queue_while_refused(stranger, [b"h", b"x" * 4096, b"y" * 4096])
        assert server.recv(timeout_ms=300) is None
        assert not server.socket.poll(0)         # not even a malformed message to drop
        member: RequestClient[FromKvCache] = RequestClient(ctx, Codec(FromKvCache, key=KEY),
                                                           server.address)
        member.socket.send(Codec(ToKvCache, key=KEY).encode(DropPool(1)))
        got = server.recv(timeout_ms=2000)
        assert got is not None and got[1] == DropPool(1)
        stranger.close(linger=0)
        member.close()
        server.close()
    finally:
        ctx.destroy(linger=0)


def test_without_a_key_listeners_stay_open() -> None:
    # Unit tests build codecs without a key: their frames are untagged, their sockets open.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PULL)
        guard_listener(ctx, sock, None)
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
        sock.close(linger=0)
    finally:
        ctx.term()


def test_a_call_to_a_listener_without_the_gate_times_out() -> None:
    """A member calling a listener that speaks no PLAIN (a stranger's, or an older build's):
    the handshake fails on the mechanism, the DEALER keeps no connection to queue on, and a
    send there blocks. The call must still end within its timeout, unanswered (it once hung
    the worker's KV loader forever)."""
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.ROUTER)
        stranger.setsockopt(zmq.LINGER, 0)
        port = stranger.bind_to_random_port("tcp://127.0.0.1")
        client: RequestClient[FromKvCache] = RequestClient(ctx, Codec(FromKvCache, key=KEY),
                                                           f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)                      # the handshake is tried and fails
        started = time.monotonic()
        assert client.call(DropPool(0), timeout_ms=400) is None
        assert client.call(DropPool(0), timeout_ms=400) is None
        assert time.monotonic() - started < 3
        client.close()
        stranger.close()
    finally:
        ctx.term()
