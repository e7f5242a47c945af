"""End to end: `python -m kvcache_svc` as a real process, driven over ZMQ and gRPC."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.server import KvCachePools
from services.block_hash import hash_full_blocks
from services.channels import RequestClient, tcp_address
from services.codec import Codec
from services.rpc.splitserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from services.wire import (
    AdmitOp,
    ConfigurePool,
    DropPool,
    FromKvCache,
    KvAck,
    PlanReply,
    PlanRequest,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
TIMEOUT_MS = 5000
BLOCK_SIZE = 4


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


def start_service(plan_port: int, admin_port: int) -> Service:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT),
           "SPLITSERVE_KV_ADMIN_PORT": str(admin_port)}    # exercises the env fallback
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache_svc", "--host", HOST, "--plan-port", str(plan_port)],
        cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return Service(proc, lines, plan_port, admin_port)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    svc = start_service(free_port(), free_port())
    try:
        ready = svc.wait_for("kvcache_svc ready")
        assert f"plan=tcp://{HOST}:{svc.plan_port} admin={HOST}:{svc.admin_port}" in ready
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def client(service: Service, ctx: zmq.Context) -> Iterator[RequestClient[FromKvCache]]:
    rpc: RequestClient[FromKvCache] = RequestClient(
        ctx, Codec(FromKvCache), tcp_address(HOST, service.plan_port))
    yield rpc
    rpc.close()


@pytest.fixture
def channel(service: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"{HOST}:{service.admin_port}") as chan:
        yield chan


def configure(client: RequestClient[FromKvCache], replica_id: int, num_blocks: int) -> None:
    ack = client.call(ConfigurePool(replica_id, num_blocks, BLOCK_SIZE, True), TIMEOUT_MS)
    assert ack == KvAck(None)


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
    assert reply.admitted[0].block_ids == [1, 2, 3] and reply.num_free_blocks == 5
    reply = client.call(admit_plan(1, 8, "b", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.admitted[0].num_cached_tokens == 8

    reply = client.call(admit_plan(1, 9, "b", prompt), TIMEOUT_MS)   # b holds blocks
    assert isinstance(reply, PlanReply) and reply.error and reply.plan_id == 9
    reply = client.call(admit_plan(99, 10, "a", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and "unknown replica" in (reply.error or "")

    assert client.call(DropPool(1), TIMEOUT_MS) == KvAck(None)
    reply = client.call(admit_plan(1, 11, "a", prompt), TIMEOUT_MS)
    assert isinstance(reply, PlanReply) and reply.error


def test_configure_refuses_an_oversized_pool(client: RequestClient[FromKvCache]) -> None:
    ack = client.call(ConfigurePool(2, (1 << 31) - 1, BLOCK_SIZE, True), TIMEOUT_MS)
    assert isinstance(ack, KvAck) and ack.error


def test_garbage_frames_are_dropped_and_serving_goes_on(
        service: Service, ctx: zmq.Context, client: RequestClient[FromKvCache]) -> None:
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(tcp_address(HOST, service.plan_port))
    raw.send(b"\xc1 not msgpack")
    raw.send(b"\x93\x01\x02")                    # msgpack, but no wire struct
    raw.send_multipart([b"two", b"parts"])
    assert not raw.poll(300)                     # dropped, not answered
    raw.close()
    service.wait_for("dropping")
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
    stats = stub.Stats(kvcache_pb2.StatsRequest(), timeout=5)
    pool = next(p for p in stats.pools if p.replica_id == 4)
    assert (pool.block_size, pool.num_blocks, pool.num_used_blocks) == (BLOCK_SIZE, 8, 0)
    assert (pool.num_cached_blocks, pool.num_queries, pool.num_hits) == (3, 24, 8)
    assert pool.hit_rate == pytest.approx(1 / 3) and pool.num_requests == 0
    assert stats.num_plans >= 3

    assert stub.Clear(kvcache_pb2.ClearRequest(replica_id=4), timeout=5).num_cleared == 3
    assert stub.Clear(kvcache_pb2.ClearRequest(), timeout=5).num_cleared == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Clear(kvcache_pb2.ClearRequest(replica_id=12345), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_is_serving(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "splitserve.v1.KvCacheAdmin"):
        response = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_exits_cleanly() -> None:
    svc = start_service(free_port(), free_port())
    try:
        svc.wait_for("kvcache_svc ready")
    finally:
        assert svc.stop() == 0


@pytest.mark.parametrize("which", ["plan", "admin"])
def test_a_taken_port_exits_with_code_1(which: str) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        svc = (start_service(port, free_port()) if which == "plan"
               else start_service(free_port(), port))
        try:
            svc.wait_for(f"cannot bind {which}")
            assert svc.proc.wait(timeout=10) == 1
        finally:
            svc.stop()


def test_a_failure_inside_a_plan_becomes_an_error_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pools = KvCachePools()
    assert pools.handle(ConfigurePool(0, 8, BLOCK_SIZE, True)) == KvAck(None)

    def broken(self: ReplicaBlockManager, plan: PlanRequest) -> PlanReply:
        raise RuntimeError("boom")

    monkeypatch.setattr(ReplicaBlockManager, "apply", broken)
    reply = pools.handle(admit_plan(0, 5, "a", [1, 2, 3]))
    assert isinstance(reply, PlanReply) and reply.plan_id == 5
    assert "boom" in (reply.error or "")
    monkeypatch.undo()
    reply = pools.handle(admit_plan(0, 6, "a", [1, 2, 3]))
    assert isinstance(reply, PlanReply) and reply.error is None
