"""EventPublisher: KV event batches from KvCachePools reach a real SUB socket, in order, as
frames the codec validates."""

import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from kvcache_svc.events import EventPublisher
from kvcache_svc.pools import KvCachePools
from services.block_hash import hash_full_blocks
from services.codec import Codec
from services.kv_wire import (
    AdmitOp,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConfigurePool,
    DropPool,
    KvAck,
    KvEventBatch,
    PlanReply,
    PlanRequest,
)

HOST = "127.0.0.1"
BLOCK_SIZE = 4
EPOCH = 7
PROBE_REPLICA = 999  # batches sent only to learn that the subscription is live


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def publisher(ctx: zmq.Context) -> Iterator[EventPublisher]:
    pub = EventPublisher(ctx, HOST, 0)
    yield pub
    pub.close()


def subscribe(ctx: zmq.Context, publisher: EventPublisher) -> zmq.Socket:
    """A SUB socket that is known to receive: ZMQ drops what a PUB sends before the
    subscription reaches it (slow joiner), so probe batches go out until one arrives."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.address)
    probe = KvEventBatch(EPOCH, 0, PROBE_REPLICA, [AllBlocksCleared()])
    deadline = time.monotonic() + 5
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the subscription never became live"
        publisher.publish(probe)
    while sub.poll(200):                          # probes still in flight
        sub.recv()
    return sub


def receive(sub: zmq.Socket) -> KvEventBatch:
    assert sub.poll(5000), "no event batch"
    return Codec(KvEventBatch).decode(sub.recv())


def admit_plan(replica_id: int, plan_id: int, request_id: str, token_ids: list[int],
               free_ids: list[str] | None = None) -> PlanRequest:
    op = AdmitOp(request_id, len(token_ids), hash_full_blocks(token_ids, BLOCK_SIZE),
                 max_num_new_tokens=1024, allow_partial=False)
    return PlanRequest(replica_id, plan_id, free_ids or [], [], [op])


def test_a_subscriber_sees_every_index_change_in_order(ctx: zmq.Context,
                                                       publisher: EventPublisher) -> None:
    pools = KvCachePools(epoch=EPOCH, publish=publisher.publish)
    sub = subscribe(ctx, publisher)
    assert pools.handle(ConfigurePool(0, 4, BLOCK_SIZE, True)) == KvAck(None, EPOCH)  # 3 blocks
    assert pools.handle(ConfigurePool(1, 5, BLOCK_SIZE, True)) == KvAck(None, EPOCH)
    assert not sub.poll(100)                      # new pools change no index

    first = list(range(9))                        # 3 blocks, 2 of them full
    reply = pools.handle(admit_plan(0, 1, "a", first))
    assert isinstance(reply, PlanReply) and reply.error is None
    batch = receive(sub)
    assert batch == KvEventBatch(EPOCH, 0, 0, [BlockStored(hash_full_blocks(first, BLOCK_SIZE))])

    # b needs all 3 blocks: a's unhashed tail, then its cached 2nd and 1st (tail evicted first).
    second = list(range(100, 112))
    pools.handle(admit_plan(0, 2, "b", second, free_ids=["a"]))
    assert receive(sub) == KvEventBatch(EPOCH, 1, 0, [
        BlockRemoved(hash_full_blocks(first, BLOCK_SIZE)[::-1]),
        BlockStored(hash_full_blocks(second, BLOCK_SIZE))])

    pools.handle(admit_plan(1, 3, "c", first))
    pools.handle(PlanRequest(1, 4, ["c"], [], []))           # frees: no index change
    assert pools.clear(1) == 2                    # every cached block was free
    assert receive(sub) == KvEventBatch(EPOCH, 2, 1,
                                        [BlockStored(hash_full_blocks(first, BLOCK_SIZE))])
    assert receive(sub) == KvEventBatch(EPOCH, 3, 1, [AllBlocksCleared()])

    assert pools.handle(DropPool(0)) == KvAck(None, EPOCH)
    assert receive(sub) == KvEventBatch(EPOCH, 4, 0, [AllBlocksCleared()])
    assert not sub.poll(100)
    sub.close()


def test_port_zero_picks_a_free_port(publisher: EventPublisher) -> None:
    assert publisher.port > 0 and publisher.address == f"tcp://{HOST}:{publisher.port}"


def test_a_taken_port_raises_and_leaves_nothing_open(ctx: zmq.Context) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        with pytest.raises(zmq.ZMQError):
            EventPublisher(ctx, HOST, taken.getsockname()[1])
    ctx.term()                                    # would hang on a socket left open


def test_publish_after_close_is_a_no_op(ctx: zmq.Context) -> None:
    pub = EventPublisher(ctx, HOST, 0)
    pub.close()
    pub.publish(KvEventBatch(EPOCH, 0, 0, [AllBlocksCleared()]))
