"""End to end: `python -m kvcache_svc` as a real process, driven over ZMQ and gRPC, as a
member of a cluster (its token in the environment: frames tagged, admin calls with metadata)."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import cluster_token
from services.block_hash import hash_full_blocks
from services.channels import RequestClient, tcp_address
from services.codec import Codec
from services.kv_wire import (
    AdmitOp,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConfigurePool,
    DropPool,
    FromKvCache,
    KvAck,
    KvEventBatch,
    PlanReply,
    PlanRequest,
    PrefixQuery,
    PrefixReply,
)
from services.rpc.splitserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.zmq_gate import present_credentials

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
TIMEOUT_MS = 5000
BLOCK_SIZE = 4
TOKEN = "test-cluster-token-0123456789"
KEY = cluster_token.frame_key(TOKEN)
AUTH = cluster_token.call_metadata(TOKEN)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    proc: subprocess.Popen
    lines: "queue.Queue[str]"                     # its stderr, line by line
    plan_port: int
    admin_port: int
    events_port: int                              # the fixture replaces 0 with the bound port
    epoch: int = 0                                # from the ready line

    def wait_for(self, text: str, timeout_s: float = 15.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in line:
                return line
        raise AssertionError(f"no {text!r} from kvcache_svc (exit code {self.proc.poll()})")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_service(plan_port: int, admin_port: int, events_port: int = 0,
                  store_port: int | None = None, args: Sequence[str] = ()) -> Service:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), cluster_token.ENV: TOKEN,
           "SPLITSERVE_KV_ADMIN_PORT": str(admin_port),      # exercises the env fallback
           "SPLITSERVE_KV_EVENTS_PORT": str(events_port),
           "SPLITSERVE_KV_STORE_PORT": str(free_port() if store_port is None else store_port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache_svc", "--host", HOST, "--plan-port", str(plan_port),
         *args],
        cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return Service(proc, lines, plan_port, admin_port, events_port)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    svc = start_service(free_port(), free_port())
    try:
        events = svc.wait_for("KV events on ")
        svc.events_port = int(events.rsplit(f"tcp://{HOST}:", 1)[1])
        ready = svc.wait_for("kvcache_svc ready")
        assert f"plan=tcp://{HOST}:{svc.plan_port} admin={HOST}:{svc.admin_port}" in ready
        svc.epoch = int(ready.rsplit("epoch=", 1)[1])
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def client(service: Service, ctx: zmq.Context) -> Iterator[RequestClient[FromKvCache]]:
    rpc: RequestClient[FromKvCache] = RequestClient(
        ctx, Codec(FromKvCache, key=KEY), tcp_address(HOST, service.plan_port))
    yield rpc
    rpc.close()


@pytest.fixture
def channel(service: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"{HOST}:{service.admin_port}") as chan:
        yield chan


def configure(client: RequestClient[FromKvCache], replica_id: int, num_blocks: int) -> None:
    ack = client.call(ConfigurePool(replica_id, num_blocks, BLOCK_SIZE, True), TIMEOUT_MS)
    assert isinstance(ack, KvAck) and ack.error is None


def admit_plan(replica_id: int, plan_id: int, request_id: str,
               token_ids: list[int]) -> PlanRequest:
    op = AdmitOp(request_id, len(token_ids), hash_full_blocks(token_ids, BLOCK_SIZE),
                 max_num_new_tokens=1024, allow_partial=False)
    return PlanRequest(replica_id, plan_id, [], [], [op])


def test_plans_are_applied_per_replica(client: RequestClient[FromKvCache]) -> None:
    configure(client, 1, num_blocks=9)
    prompt = list(range(10))
    reply = client.call(admit_plan(1, 7, "a", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.error is None and reply.plan_id == 7
    assert reply.admitted[0].block_ids[0] == [1, 2, 3] and reply.num_free_blocks == 5
    reply = client.call(admit_plan(1, 8, "b", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.admitted[0].num_cached_tokens == 8

    reply = client.call(admit_plan(1, 9, "b", prompt), TIMEOUT_MS)   # b holds blocks
    assert isinstance(reply, PlanReply) and reply.error and reply.plan_id == 9
    reply = client.call(admit_plan(99, 10, "a", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and "unknown replica 99" in (reply.error or "")
    assert "not configured" in (reply.error or "")

    ack = client.call(DropPool(1), TIMEOUT_MS)
    assert isinstance(ack, KvAck) and ack.error is None
    reply = client.call(admit_plan(1, 11, "a", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.error


def test_configure_refuses_an_oversized_pool(client: RequestClient[FromKvCache]) -> None:
    ack = client.call(ConfigurePool(2, (1 << 31) - 1, BLOCK_SIZE, True), TIMEOUT_MS)
    assert isinstance(ack, KvAck) and ack.error


def test_configure_refuses_an_epoch_from_the_far_future(
        client: RequestClient[FromKvCache]) -> None:
    # It would supersede every real scheduler until kvcache_svc restarted.
    ack = client.call(ConfigurePool(2, 9, BLOCK_SIZE, True, scheduler_epoch=2**63 - 1),
                      TIMEOUT_MS)
    assert isinstance(ack, KvAck) and "more than a day ahead" in (ack.error or "")
    configure(client, 2, num_blocks=9)            # a real scheduler still can


def test_garbage_frames_are_dropped_and_serving_goes_on(
        service: Service, ctx: zmq.Context, client: RequestClient[FromKvCache]) -> None:
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    present_credentials(raw, KEY)    # a member's socket: the frames themselves are refused
    raw.connect(tcp_address(HOST, service.plan_port))
    raw.send(b"\xc1 not msgpack")
    raw.send(b"\x93\x01\x02")                    # msgpack, but no wire struct
    raw.send_multipart([b"two", b"parts"])
    assert not raw.poll(300)                     # dropped, not answered
    raw.close()
    service.wait_for("refused requests on")
    configure(client, 3, num_blocks=4)
    assert service.proc.poll() is None


def test_admin_stats_and_clear(client: RequestClient[FromKvCache],
                               channel: grpc.Channel) -> None:
    configure(client, 4, num_blocks=9)
    prompt = list(range(100, 112))
    client.call(admit_plan(4, 1, "a", prompt), TIMEOUT_MS)
    client.call(admit_plan(4, 2, "b", prompt), TIMEOUT_MS)
    reply = client.call(PlanRequest(4, 3, ["a", "b"], [], []), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.error is None

    stub = kvcache_pb2_grpc.KvCacheAdminStub(channel)
    stats = stub.Stats(kvcache_pb2.StatsRequest(), timeout=5, metadata=AUTH)
    pool = next(p for p in stats.pools if p.replica_id == 4)
    assert (pool.block_size, pool.num_blocks, pool.num_used_blocks) == (BLOCK_SIZE, 8, 0)
    assert (pool.num_cached_blocks, pool.num_queries, pool.num_hits) == (3, 24, 8)
    assert pool.hit_rate == pytest.approx(1 / 3) and pool.num_requests == 0
    assert stats.num_plans >= 3

    assert stub.Clear(kvcache_pb2.ClearRequest(replica_id=4), timeout=5,
                      metadata=AUTH).num_cleared == 3
    assert stub.Clear(kvcache_pb2.ClearRequest(), timeout=5, metadata=AUTH).num_cleared == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Clear(kvcache_pb2.ClearRequest(replica_id=12345), timeout=5, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_is_serving(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "splitserve.v1.KvCacheAdmin"):
        response = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_every_reply_carries_the_instance_epoch(service: Service,
                                                client: RequestClient[FromKvCache]) -> None:
    assert 0 < service.epoch <= time.time_ns()
    replies = [client.call(ConfigurePool(5, 9, BLOCK_SIZE, True), TIMEOUT_MS),
               client.call(admit_plan(5, 1, "a", list(range(9))), TIMEOUT_MS),
               client.call(admit_plan(12345, 2, "a", [1]), TIMEOUT_MS),   # unknown replica
               client.call(PrefixQuery([]), TIMEOUT_MS),
               client.call(DropPool(5), TIMEOUT_MS)]
    for reply in replies:
        assert isinstance(reply, PlanReply | KvAck | PrefixReply), reply
        assert reply.epoch == service.epoch


def test_prefix_query_over_the_plan_socket(client: RequestClient[FromKvCache]) -> None:
    configure(client, 6, num_blocks=9)
    configure(client, 7, num_blocks=9)
    prompt = list(range(200, 213))                # 3 full blocks
    client.call(admit_plan(6, 1, "a", prompt), TIMEOUT_MS)
    reply = client.call(PrefixQuery(hash_full_blocks(prompt, BLOCK_SIZE)), TIMEOUT_MS)
    assert isinstance(reply, PrefixReply)
    assert [r.replica_id for r in reply.replicas] == sorted(r.replica_id for r in reply.replicas)
    found = {r.replica_id: r.num_cached_blocks for r in reply.replicas}
    assert (found[6], found[7]) == (3, 0)


def test_events_reach_a_subscriber(service: Service, ctx: zmq.Context,
                                   client: RequestClient[FromKvCache]) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    present_credentials(sub, KEY)    # the feed serves members only (test_outsider.py)
    sub.connect(tcp_address(HOST, service.events_port))
    codec = Codec(KvEventBatch, key=KEY)

    def receive() -> KvEventBatch:
        assert sub.poll(TIMEOUT_MS), "no event batch"
        return codec.decode(sub.recv())

    # Slow joiner: batches published before the subscription lands are dropped. Re-configuring
    # a pool publishes AllBlocksCleared; repeat until one arrives, then let the rest drain.
    configure(client, 8, num_blocks=4)            # 3 usable blocks
    while not sub.poll(50):
        configure(client, 8, num_blocks=4)
    while sub.poll(200):
        last = codec.decode(sub.recv())
    assert last.epoch == service.epoch and last.events == [AllBlocksCleared()]

    prompt = list(range(300, 309))                # 2 full blocks of 3
    hashes = hash_full_blocks(prompt, BLOCK_SIZE)
    client.call(admit_plan(8, 1, "a", prompt), TIMEOUT_MS)
    stored = receive()
    assert stored == KvEventBatch(service.epoch, last.seq + 1, 8, [BlockStored(hashes)])
    other = list(range(400, 412))                 # takes all 3 blocks: a's are evicted
    client.call(PlanRequest(8, 2, ["a"], [], []), TIMEOUT_MS)
    client.call(admit_plan(8, 3, "b", other), TIMEOUT_MS)
    assert receive() == KvEventBatch(service.epoch, last.seq + 2, 8, [
        BlockRemoved(hashes[::-1]), BlockStored(hash_full_blocks(other, BLOCK_SIZE))])
    client.call(DropPool(8), TIMEOUT_MS)
    assert receive() == KvEventBatch(service.epoch, last.seq + 3, 8, [AllBlocksCleared()])
    sub.close()


def test_sigterm_exits_cleanly() -> None:
    svc = start_service(free_port(), free_port())
    try:
        svc.wait_for("kvcache_svc ready")
    finally:
        assert svc.stop() == 0


@pytest.mark.parametrize("which", ["plan", "admin", "events", "KV store"])
def test_a_taken_port_exits_with_code_1(which: str) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"plan": free_port(), "admin": free_port(), "events": free_port(),
                 "KV store": free_port(), which: port}
        svc = start_service(ports["plan"], ports["admin"], ports["events"], ports["KV store"])
        try:
            svc.wait_for(f"cannot bind {which}")
            assert svc.proc.wait(timeout=10) == 1
        finally:
            svc.stop()


def test_strangers_cannot_act_on_the_pools(service: Service, ctx: zmq.Context,
                                           client: RequestClient[FromKvCache],
                                           channel: grpc.Channel) -> None:
    # Without the cluster token: a plan-socket DropPool (or any frame) is never read (the
    # handshake refuses the peer, logged) or, from a peer past the handshake whose frames are
    # not tagged with the cluster's key, dropped and logged; admin calls are UNAUTHENTICATED
    # (a wrong token too); health stays open.
    configure(client, 9, num_blocks=9)
    client.call(admit_plan(9, 1, "a", list(range(300, 312))), TIMEOUT_MS)
    other_key = cluster_token.frame_key("another-cluster-token")
    stranger: RequestClient[FromKvCache] = RequestClient(
        ctx, Codec(FromKvCache), tcp_address(HOST, service.plan_port))
    impostor: RequestClient[FromKvCache] = RequestClient(
        ctx, Codec(FromKvCache, key=other_key), tcp_address(HOST, service.plan_port))
    for outsider in (stranger, impostor):
        assert outsider.call(DropPool(9), timeout_ms=300) is None
        outsider.close()
    service.wait_for("wrong cluster credentials")
    forger = ctx.socket(zmq.DEALER)          # the handshake passed, the frame's tag is wrong
    forger.setsockopt(zmq.LINGER, 0)
    present_credentials(forger, KEY)
    forger.connect(tcp_address(HOST, service.plan_port))
    forger.send(Codec(FromKvCache, key=other_key).encode(DropPool(9)))
    assert not forger.poll(300)
    forger.close()
    # (Its log line may be folded into 127.0.0.1's count: refusals are logged once per peer
    # and interval, tests/services/test_refusal_log.py; what counts is that nothing applied.)
    reply = client.call(admit_plan(9, 2, "b", list(range(300, 312))), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.admitted[0].num_cached_tokens == 8

    stub = kvcache_pb2_grpc.KvCacheAdminStub(channel)
    for metadata in [None, cluster_token.call_metadata("not-the-cluster-token")]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Clear(kvcache_pb2.ClearRequest(), timeout=5, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "cluster token" in (err.value.details() or "")
    service.wait_for("refused control-plane calls from")
    pool = next(p for p in stub.Stats(kvcache_pb2.StatsRequest(), timeout=5,
                                      metadata=AUTH).pools if p.replica_id == 9)
    assert pool.num_cached_blocks == 3                   # nothing was cleared


@pytest.mark.parametrize("store_on", [True, False], ids=["store", "no-store"])
def test_admin_stats_report_the_kv_store(ctx: zmq.Context, store_on: bool) -> None:
    """Admin Stats carries the store's counters and tiers (unset with --no-kv-store)."""
    from services.kv_chunks import KvSlice, make_chunk
    from services.kv_store_client import KvStoreClient
    from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore

    store_port = free_port()
    svc = start_service(free_port(), free_port(), store_port=store_port,
                        args=() if store_on else ("--no-kv-store",))
    try:
        svc.wait_for("kvcache_svc ready")
        with grpc.insecure_channel(f"{HOST}:{svc.admin_port}") as channel:
            stub = kvcache_pb2_grpc.KvCacheAdminStub(channel)
            if not store_on:
                stats = stub.Stats(kvcache_pb2.StatsRequest(), timeout=5, metadata=AUTH)
                assert not stats.HasField("store")
                return
            client = KvStoreClient(ctx, tcp_address(HOST, store_port), timeout_ms=5000,
                                   codec=Codec(FromKvStore, MAX_STORE_HEADER_BYTES, key=KEY))
            try:
                kv_slice = KvSlice("m", "float32", 0, 2, 0, 1)
                keys = [kv_slice.key(bytes([i]) * 32, 256) for i in range(3)]
                chunks = [make_chunk(k, (2, 2, 256, 1, 4), bytes(2 * 2 * 256 * 4 * 4))
                          for k in keys[:2]]
                assert client.save(chunks).num_stored_chunks == 2
                assert client.lookup(keys) == 2
            finally:
                client.close()
            stats = stub.Stats(kvcache_pb2.StatsRequest(), timeout=5, metadata=AUTH)
    finally:
        svc.stop()
    store = stats.store
    assert (store.chunk_tokens, store.num_stored_chunks, store.num_stored_tokens) == (256, 2, 512)
    assert store.num_stored_bytes == 2 * 16384
    assert (store.num_hit_tokens, store.num_miss_tokens) == (0, 0)   # no admission asked
    memory = next(t for t in store.tiers if t.name == "memory")
    assert memory.num_chunks == 2 and memory.num_bytes >= 2 * 16384
    assert memory.capacity_bytes == 2 << 30
