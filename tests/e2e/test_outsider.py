"""A running cluster probed as an outsider would (issue 24, point 5), the services as real
processes: an anonymous multipart message to the KV store (or the plan socket) is refused
before it is buffered (kvcache_svc's RSS stays put); a peer hammering with wrong credentials
or bad frames writes a line or two, not thousands; the KV events feed serves members only;
the metrics listener holds a bounded number of threads against idle half-sent requests and
writes no tracebacks when they close; --max-prompt-bytes of 2^31 is a clear start-up error."""

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from services import refusal_log
from services.channels import RequestClient, tcp_address
from services.cluster_token import frame_key
from services.codec import Codec
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore
from services.kv_wire import (
    ConfigurePool,
    FromKvCache,
    KvAck,
    KvEventBatch,
    ToKvCache,
)
from services.launcher import INTERNAL_HOST, REPO_ROOT, ClusterSpec, ServiceProcesses
from services.zmq_gate import present_credentials
from tests.e2e.harness import free_ports, wait_for
from tests.services.refused_peer import queue_while_refused

pytestmark = pytest.mark.e2e

MIB = 1 << 20


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def num_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcesses]:
    """kvcache_svc and the scheduler, no workers: everything an outsider can reach."""
    port, control, plan, admin, events, metrics, store = free_ports(7)
    spec = ClusterSpec(port=port, control_port=control, kv_plan_port=plan, kv_admin_port=admin,
                       kv_events_port=events, kv_store_port=store, metrics_port=metrics,
                       num_replicas=0)
    procs = ServiceProcesses(spec, tmp_path_factory.mktemp("outsider"))
    procs.start_kvcache()
    procs.start_scheduler()
    try:
        assert wait_for(lambda: "kvcache_svc ready" in log(procs, "kvcache"), 60), \
            log(procs, "kvcache")
        assert wait_for(lambda: "Prometheus metrics on" in log(procs, "scheduler"), 60), \
            log(procs, "scheduler")
        yield procs
    finally:
        codes = procs.stop()
        assert all(c in (0, -15) for c in codes.values()), codes


def log(procs: ServiceProcesses, name: str) -> str:
    assert procs.log_dir is not None
    path = procs.log_dir / f"{name}.log"
    return path.read_text() if path.exists() else ""


def test_an_anonymous_gigabyte_is_refused_before_it_is_buffered(
        cluster: ServiceProcesses) -> None:
    pid = cluster.procs["kvcache"].pid
    before = rss_mib(pid)
    ctx = zmq.Context()
    try:
        big = b"\0" * (256 * MIB)                 # sent 4 times without a copy
        plan_frame = b"p" * (32 * MIB)
        store = ctx.socket(zmq.DEALER)
        plan = ctx.socket(zmq.DEALER)
        for sock, port, frames in ((store, cluster.spec.kv_store_port,
                                    [b"header", big, big, big, big]),
                                   (plan, cluster.spec.kv_plan_port, [plan_frame] * 4)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(tcp_address(INTERNAL_HOST, port))
            # Queued at once on the pipe connect() made (NOBLOCK: it is accepted, not
            # waiting for a connection). Each frame is under the socket's per-frame limit
            # (512 MiB at the store, 64 MiB at the plan socket); together 1 GiB and 128 MiB.
            queue_while_refused(sock, frames, copy=False)
        time.sleep(3)
        after = rss_mib(pid)
        assert after - before < 64, f"kvcache_svc grew from {before:.0f} to {after:.0f} MiB"
        # The members are still served.
        codec = Codec(FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES,
                      key=frame_key(cluster.cluster_token))
        member = KvStoreClient(ctx, tcp_address(INTERNAL_HOST, cluster.spec.kv_store_port),
                               codec=codec)
        assert member.describe() is not None
        member.close()
        store.close(linger=0)
        plan.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    assert cluster.procs["kvcache"].poll() is None


def test_refusals_are_logged_once_per_peer_and_interval(cluster: ServiceProcesses) -> None:
    key = frame_key(cluster.cluster_token)
    wrong = frame_key("not-this-clusters-token-0123456789")
    plan_address = tcp_address(INTERNAL_HOST, cluster.spec.kv_plan_port)
    ctx = zmq.Context()
    try:
        # A peer with the wrong secret, reconnecting every millisecond for two seconds.
        impostor = ctx.socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.setsockopt(zmq.RECONNECT_IVL, 1)
        present_credentials(impostor, wrong)
        impostor.connect(plan_address)
        # A member's socket sending 20,000 frames without a valid tag.
        forger = ctx.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        present_credentials(forger, key)
        forger.connect(plan_address)
        bad = Codec(ToKvCache, key=wrong).encode(ConfigurePool(1, 4, 16, True))
        for _ in range(20_000):
            forger.send(bad)
        time.sleep(2)
        impostor.close(linger=0)
        forger.close(linger=0)
        # The plan socket still answers a member.
        client: RequestClient[FromKvCache] = RequestClient(ctx, Codec(FromKvCache, key=key),
                                                           plan_address)
        assert isinstance(client.call(ConfigurePool(7, 4, 16, True), 5000), KvAck)
        client.close()
    finally:
        ctx.destroy(linger=0)
    text = log(cluster, "kvcache")
    handshakes = text.count("wrong cluster credentials")
    frames = text.count("without a valid cluster token")
    assert 1 <= handshakes <= 2, text[-3000:]
    assert 1 <= frames <= 2, text[-3000:]
    assert len(text.splitlines()) < 100


def test_the_events_feed_serves_members_only(cluster: ServiceProcesses) -> None:
    key = frame_key(cluster.cluster_token)
    events_address = tcp_address(INTERNAL_HOST, cluster.spec.kv_events_port)
    ctx = zmq.Context()
    try:
        subs = {}
        for name, credentials in (("stranger", None), ("member", key)):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            present_credentials(sub, credentials)
            sub.connect(events_address)
            subs[name] = sub
        client: RequestClient[FromKvCache] = RequestClient(
            ctx, Codec(FromKvCache, key=key), tcp_address(INTERNAL_HOST,
                                                          cluster.spec.kv_plan_port))
        codec = Codec(KvEventBatch, key=key)
        got: list[KvEventBatch] = []
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:  # PUB/SUB joins late: publish again
            assert isinstance(client.call(ConfigurePool(8, 4, 16, True), 5000), KvAck)
            while subs["member"].poll(200):
                got.append(codec.decode(subs["member"].recv()))
        assert got, "the member saw no event batch"
        assert not subs["stranger"].poll(500), "a stranger received KV events"
        client.close()
        for sub in subs.values():
            sub.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_idle_half_sent_metrics_requests_hold_bounded_threads(
        cluster: ServiceProcesses) -> None:
    pid = cluster.procs["scheduler"].pid
    base = num_threads(pid)
    started = time.monotonic()
    address = (INTERNAL_HOST, cluster.spec.metrics_port)
    idle = []
    for _ in range(200):
        s = socket.create_connection(address, timeout=5)
        s.sendall(b"GET /metr")                     # and never the rest
        idle.append(s)
    time.sleep(1)
    held = num_threads(pid)
    assert held <= base + 16 + 4, f"{held} threads (from {base}) for 200 idle connections"
    for s in idle:
        s.close()
    # Slots free as their connections end; a scrape is answered again.
    def scraped() -> bool:
        try:
            url = f"http://{INTERNAL_HOST}:{cluster.spec.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=2) as r:
                return b"vllm:num_requests_running" in r.read()
        except OSError:
            return False

    assert wait_for(scraped, 15)
    assert wait_for(lambda: num_threads(pid) <= base + 2, 15), (num_threads(pid), base)
    text = log(cluster, "scheduler")
    assert "Traceback" not in text, text[-3000:]
    # One line per peer per 10 s interval, with its count: a first line and a count line for
    # each interval the test spanned (a loaded machine spans more than one), never one per
    # refused connection.
    intervals = 1 + int((time.monotonic() - started) // refusal_log.INTERVAL_S)
    assert text.count("metrics connections") <= 2 * intervals


def test_a_prompt_limit_past_32_bits_is_a_clear_start_up_error() -> None:
    done = subprocess.run([sys.executable, "-m", "scheduler_svc", "--max-prompt-bytes",
                           str(1 << 31)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--max-prompt-bytes must be in [1, " in done.stderr
    assert "Traceback" not in done.stderr
