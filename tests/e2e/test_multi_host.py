"""A cluster split across hosts: every service on an address of its own (network namespaces
joined by a bridge, made by the test: tests/e2e/netns.py), talking over the network between
them.

    sched 10.X.Y.2   scheduler_svc (public API, control listener, output sockets)
    kv    10.X.Y.3   kvcache_svc (plan, admin, events, KV store)
    w0-w3 .4 - .7    one worker each; --pp 2, so each replica's two stages sit on two hosts
                     and their activations (gloo) and rendezvous cross the network

Checks: both replicas form and answer greedy requests token-exact against HF; every process
listens only on its own host's address (no wildcard, no loopback); a stranger on the network
is refused the control plane without the cluster token; then a stage's host is unplugged
mid-stream (its link goes down): the scheduler notices (heartbeats), the requests of that
replica move to the other one and finish exact, and the cluster serves on.

Needs root (namespaces); skipped with the reason elsewhere.
"""

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services import cluster_token
from services.rpc.splitserve.v1 import (
    control_pb2,
    control_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import assert_matches_reference, greedy_request, wait_for
from tests.e2e.listeners import listening
from tests.e2e.netns import Network, unavailable

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["sched", "kv", "w0", "w1", "w2", "w3"]
WORKERS = HOSTS[2:]
PORT, CONTROL_PORT, METRICS_PORT = 50051, 50052, 8000
PLAN_PORT, ADMIN_PORT, EVENTS_PORT, STORE_PORT = 50053, 50054, 50055, 50057
HEARTBEAT_TIMEOUT_S = 2.0


class Hosts:
    """The services started on their hosts, with their logs."""

    def __init__(self, net: Network, logs: Path) -> None:
        self.net = net
        self.logs = logs
        self.procs: dict[str, int] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
        self.env.update({cluster_token.ENV: cluster_token.generate(), "PYTHONUNBUFFERED": "1",
                         "PYTHONPATH": str(ROOT)})

    def start(self, host: str, module: str, *args: str) -> None:
        log = open(self.logs / f"{host}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = self.net.popen(host, [sys.executable, "-m", module, *args], log, self.env)
        self.procs[host] = proc.pid

    def text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.logs.glob("*.log")))


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    if reason := unavailable():
        pytest.skip(f"a cluster across hosts needs network namespaces: {reason}")
    with Network.create(HOSTS) as net:
        hosts = Hosts(net, tmp_path)
        a = net.address
        hosts.start("kv", "kvcache_svc", "--host", a("kv"), "--plan-port", str(PLAN_PORT),
                    "--admin-port", str(ADMIN_PORT), "--events-port", str(EVENTS_PORT),
                    "--kv-store-port", str(STORE_PORT))
        hosts.start("sched", "scheduler_svc", "--host", a("sched"), "--port", str(PORT),
                    "--control-host", a("sched"), "--control-port", str(CONTROL_PORT),
                    "--advertise-host", a("sched"), "--metrics-port", str(METRICS_PORT),
                    "--kvcache", f"tcp://{a('kv')}:{PLAN_PORT}", "--pp", "2",
                    "--dtype", "float32", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
        for worker in WORKERS:
            hosts.start(worker, "worker_svc", "--scheduler", f"{a('sched')}:{CONTROL_PORT}",
                        "--host", a(worker), "--worker-id", worker, "--threads", "1",
                        "--kv-cache-memory-gib", "0.25",
                        "--kv-store", f"tcp://{a('kv')}:{STORE_PORT}")
        yield hosts


def ready(stub: generation_pb2_grpc.GenerationStub) -> list[generation_pb2.ReplicaInfo]:
    try:
        info = stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=2)
    except grpc.RpcError:
        return []
    return [r for r in info.replicas if r.state == "ready"]


def test_a_cluster_across_hosts_survives_a_host_cut_off(hosts: Hosts, prompts,  # type: ignore[no-untyped-def]
                                                         references) -> None:
    net = hosts.net
    address = f"{net.address('sched')}:{PORT}"
    channel = grpc.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    assert wait_for(lambda: len(ready(stub)) == 2, timeout_s=150, interval_s=0.5), \
        f"two pp=2 replicas did not form\n{hosts.text()}"
    for replica in ready(stub):
        assert len({w.worker_id for w in replica.workers}) == 2      # stages on two hosts

    # Every socket of every process on its own host's address: nothing on 0.0.0.0 or ::, nor
    # on loopback (the rendezvous store, gloo's pairs, the step sockets included).
    for host, pid in hosts.procs.items():
        sockets = listening(pid)
        assert sockets and {h for h, _ in sockets} == {net.address(host)}, (host, sockets)

    # A stranger on the network (this test's own address) may not join without the token.
    with grpc.insecure_channel(f"{net.address('sched')}:{CONTROL_PORT}") as control:
        with pytest.raises(grpc.RpcError) as refused:
            control_pb2_grpc.WorkerControlStub(control).Register(control_pb2.RegisterRequest(
                worker_id="stranger", epoch=1, step_address="tcp://10.0.0.1:1"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Streams on both replicas; once each has a token, unplug a host serving some of them.
    outputs: dict[int, list[int] | Exception] = {}
    started = [threading.Event() for _ in prompts[:8]]

    def stream(i: int) -> None:
        ids: list[int] = []
        try:
            for chunk in stub.Generate(greedy_request(prompts[i], MAX_TOKENS), timeout=120):
                ids.extend(chunk.token_ids)
                started[i].set()
            outputs[i] = ids
        except grpc.RpcError as exc:
            outputs[i] = exc
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(started))]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started), hosts.text()
    busiest = max(ready(stub), key=lambda r: r.num_running)
    assert busiest.num_running > 0
    (stage1,) = [w.worker_id for w in busiest.workers if w.pp_rank == 1]
    cut_at = time.monotonic()
    net.cut(stage1)
    for thread in threads:
        thread.join(timeout=150)
    for i, ours in outputs.items():
        assert isinstance(ours, list), f"stream {i} failed: {ours}\n{hosts.text()}"
        assert_matches_reference(ours, *references[i], label=f"stream {i}")
    assert len(outputs) == len(started)
    info = stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=5)
    assert info.num_migrations >= 1, info
    states = {r.replica_id: r.state for r in info.replicas}
    assert states[busiest.replica_id] == "down", states
    print(f"host {stage1} cut: {info.num_migrations} requests moved, all done "
          f"{time.monotonic() - cut_at:.1f}s after the cut")

    # The cluster serves on with the replica that is left.
    (survivor,) = ready(stub)
    for i in range(8, 10):
        ids = [t for chunk in stub.Generate(greedy_request(prompts[i], MAX_TOKENS), timeout=60)
               for t in chunk.token_ids]
        assert_matches_reference(ids, *references[i], label=f"after the cut {i}")
    assert stage1 not in {w.worker_id for w in survivor.workers}
    channel.close()
