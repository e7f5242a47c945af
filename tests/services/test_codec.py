"""Wire codec and ZMQ channels: round trips, validation, size limits, malformed frames dropped
without killing the receiver."""

import msgspec
import pytest
import zmq

from services.block_hash import hash_full_blocks
from services.channels import Receiver, Sender
from services.codec import Codec, DecodeError
from services.kv_wire import (
    PrefixQuery,
    ToKvCache,
)
from services.wire import (
    NewRequest,
    RunningRequest,
    SamplingSpec,
    StepInput,
    StepOutput,
    StepTimings,
    ToWorker,
)


def step() -> StepInput:
    spec = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=None, num_logprobs=None)
    return StepInput(
        step_id=3,
        new_requests=[NewRequest("a", [1, 2, 3], 3, spec, [[5]], 0, 3)],
        running=[RunningRequest("b", 10, 1, [[]], [])],
        finished_ids=["c"])


def test_round_trip() -> None:
    codec: Codec[StepInput] = Codec(ToWorker)
    assert codec.decode(codec.encode(step())) == step()


@pytest.mark.parametrize("frame", [
    b"",
    b"\xc1",                                            # never-used msgpack byte
    msgspec.msgpack.encode(["StepInput", 1, [], []]),   # too few fields
    msgspec.msgpack.encode(["Bogus", 1]),               # unknown tag
    msgspec.msgpack.encode(["StepInput", -1, [], [], []]),          # negative step id
    msgspec.msgpack.encode(["StepInput", 1, [], [["RunningRequest", "b", 0, 0, [[]], []]], []]),
    msgspec.msgpack.encode(["StepInput", 1, [], [["RunningRequest", "", 0, 1, [[]], []]], []]),
    msgspec.msgpack.encode(["StepInput", 1, [], [], ["x" * 300]]),  # id too long
])
def test_malformed_frames_raise_decode_error(frame: bytes) -> None:
    with pytest.raises(DecodeError):
        Codec(ToWorker).decode(frame)


def test_oversized_frame_rejected_before_parsing() -> None:
    codec = Codec(ToWorker, max_frame_bytes=64)
    big = Codec(ToWorker).encode(StepInput(1, [], [], ["x" * 100]))
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decode(big)


def test_no_pickle_on_the_wire() -> None:
    frame = Codec(ToWorker).encode(step())
    assert not frame.startswith(b"\x80")                # pickle protocol header
    assert msgspec.msgpack.decode(frame)[0] == "StepInput"


def test_receiver_drops_malformed_and_keeps_going() -> None:
    ctx = zmq.Context()
    try:
        receiver: Receiver[StepInput] = Receiver(ctx, Codec(ToWorker), "tcp://127.0.0.1:0")
        raw = ctx.socket(zmq.PUSH)
        raw.connect(receiver.address)
        sender = Sender(ctx, Codec(ToWorker), receiver.address)
        raw.send(b"\x93garbage")
        raw.send(pickle_like := b"\x80\x04\x95")
        assert pickle_like
        sender.send(step())
        assert receiver.recv(timeout_ms=2000) == step()
        assert receiver.recv(timeout_ms=50) is None
        raw.close(linger=0)
        sender.close()
        receiver.close()
    finally:
        ctx.destroy(linger=0)


def test_a_frame_above_the_limit_never_reaches_the_receiver() -> None:
    # libzmq drops the peer (ZMQ_MAXMSGSIZE) instead of buffering the frame whole before the
    # codec's own check; the receiver never decodes it and keeps serving other senders.
    ctx = zmq.Context()
    try:
        decoded: list[int] = []

        class Counting(Codec):  # type: ignore[type-arg]
            def decode(self, frame: bytes | memoryview) -> StepInput:
                decoded.append(len(frame))
                return super().decode(frame)  # type: ignore[no-any-return]

        codec = Counting(ToWorker, max_frame_bytes=1024)
        receiver: Receiver[StepInput] = Receiver(ctx, codec, "tcp://127.0.0.1:0")
        assert receiver.socket.getsockopt(zmq.MAXMSGSIZE) == 1024
        raw = ctx.socket(zmq.PUSH)
        raw.connect(receiver.address)
        raw.send(b"\x00" * 4096)
        assert receiver.recv(timeout_ms=300) is None and decoded == []
        sender = Sender(ctx, Codec(ToWorker), receiver.address)
        sender.send(step())
        assert receiver.recv(timeout_ms=2000) == step() and len(decoded) == 1
        raw.close(linger=0)
        sender.close()
        receiver.close()
    finally:
        ctx.destroy(linger=0)


def test_output_lengths_are_bounded() -> None:
    codec = Codec(StepOutput)
    out = StepOutput(1, "w", ["a"], [7], [None], StepTimings(1.0, 2.0, 3.0, 4))
    assert codec.decode(codec.encode(out)) == out


@pytest.mark.parametrize("seed", [0, 5, 2**63, 2**63 + 5, 2**64 - 1])
def test_every_uint64_seed_crosses_the_wire(seed: int) -> None:
    """SamplingParams.seed is a uint64 end to end: the wire must not lose its top bits."""
    spec = SamplingSpec(temperature=0.7, top_p=1.0, top_k=-1, seed=seed, num_logprobs=None)
    message = StepInput(step_id=1, new_requests=[NewRequest("a", [1], 1, spec, [[5]], 0, 1)],
                        running=[], finished_ids=[])
    codec: Codec[StepInput] = Codec(ToWorker)
    decoded = codec.decode(codec.encode(message))
    assert decoded.new_requests[0].sampling.seed == seed


def test_block_hashes_cross_the_wire_as_32_bytes() -> None:
    """Chained SHA-256 hashes travel whole; any other width (the former u64 included) is a
    malformed frame."""
    hashes = hash_full_blocks(list(range(12)), 4, cache_salt=b"tenant")
    codec: Codec[PrefixQuery] = Codec(ToKvCache)
    assert codec.decode(codec.encode(PrefixQuery(hashes))) == PrefixQuery(hashes)
    for bad in (hashes[0][:8], hashes[0] + b"\0", 12345):
        frame = msgspec.msgpack.encode(["PrefixQuery", [hashes[0], bad]])
        with pytest.raises(DecodeError):
            codec.decode(frame)


def test_frames_carry_the_cluster_tag() -> None:
    # A member's codec tags every frame (HMAC-SHA256 under the cluster's frame key) and
    # refuses, before parsing, a frame that is untagged, tagged under another key, or altered.
    from services import cluster_token

    key = cluster_token.frame_key("a-cluster-token-of-ours")
    member: Codec[StepInput] = Codec(ToWorker, key=key)
    frame = member.encode(step())
    assert len(frame) == len(Codec(ToWorker).encode(step())) + cluster_token.TAG_BYTES
    assert member.decode(frame) == step()
    stranger = Codec(ToWorker).encode(step())
    other = Codec(ToWorker, key=cluster_token.frame_key("someone-else's-token")).encode(step())
    altered = bytearray(frame)
    altered[5] ^= 1
    for bad in (stranger, other, bytes(altered), b"", frame[:10]):
        with pytest.raises(DecodeError, match="cluster token"):
            member.decode(bad)
    with pytest.raises(cluster_token.TokenError, match="is not set"):
        cluster_token.load({})
    with pytest.raises(cluster_token.TokenError, match="shorter"):
        cluster_token.load({cluster_token.ENV: "short"})
    assert len(cluster_token.generate()) == 64
