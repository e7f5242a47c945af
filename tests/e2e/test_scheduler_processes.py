"""The scheduler's own processes (issue 37): an engine core per replica and front ends that
share the client port, run for real.

- An engine core SIGKILLed mid-generation takes its replica down like a lost worker: its
  requests move to the other replica and finish with HF's tokens; its pool leaves
  kvcache_svc; its workers register again and form a new replica.
- Two front ends (`--frontends 2`) serve clients on separate connections, token-exact; each
  gets a share of them; Abort by request id finds the request whichever front end holds it.
"""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import greedy_request, run_cluster, wait_for
from tests.e2e.test_cluster_life import Streams, check_outputs, info, timed

pytestmark = pytest.mark.e2e
# A connection of a channel's own: gRPC shares one between channels of equal arguments.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def engine_core_pids(scheduler_pid: int) -> list[int]:
    """The engine core processes: the scheduler's children running scheduler_svc.engine."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline").read().split("\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == scheduler_pid and "scheduler_svc.engine" in cmdline:
            pids.append(int(entry))
    return pids


def replica_of_engine(log: Path, pid: int) -> int | None:
    """The replica an engine core serves, from the cluster's log line that started it."""
    for line in log.read_text().splitlines():
        if f"engine core started (pid {pid}," in line:
            return int(line.split("replica ", 1)[1].split(":", 1)[0])
    return None


def test_an_engine_core_killed_takes_its_replica_down_and_its_requests_move(
        tmp_path: Path, prompts, references) -> None:  # type: ignore[no-untyped-def]
    with run_cluster(tmp_path, num_replicas=2, worker_args=["--threads", "1"]) as cluster:
        assert wait_for(lambda: sum(r.state == "ready" for r in info(cluster).replicas) == 2,
                        60)
        streams = Streams(cluster, prompts)                 # 16 concurrent streams
        assert wait_for(lambda: streams.num_with(3) >= 8, 120)
        busiest = max(info(cluster).replicas, key=lambda r: r.num_running + r.num_waiting)
        assert busiest.num_running > 0
        scheduler = cluster.procs.procs["scheduler"].pid
        victim = next(pid for pid in engine_core_pids(scheduler)
                      if replica_of_engine(tmp_path / "scheduler.log", pid)
                      == busiest.replica_id)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        timed("engine core SIGKILL -> its replica marked down",
              lambda: any(r.replica_id == busiest.replica_id and r.state == "down"
                          for r in info(cluster).replicas), killed, 10)
        check_outputs(streams.results(), references, "after the engine core's loss")
        server = info(cluster)
        assert server.num_migrations >= busiest.num_running
        # Its pool is dropped, and its workers form a new replica with a new engine core.
        assert busiest.replica_id not in [p.replica_id for p in cluster.kv_stats().pools]
        assert wait_for(lambda: sum(r.state == "ready" for r in info(cluster).replicas) == 2,
                        60), "its workers did not form a new replica"
        assert victim not in engine_core_pids(scheduler)
        ours = [t for c in cluster.stub.Generate(greedy_request(prompts[3], MAX_TOKENS),
                                                 timeout=120) for t in c.token_ids]
        assert ours == references[3][0][:len(ours)]


def test_two_front_ends_share_the_port_and_abort_finds_any_request(
        tmp_path: Path, prompts, references) -> None:  # type: ignore[no-untyped-def]
    with run_cluster(tmp_path, scheduler_args=["--frontends", "2"]) as cluster:
        def one(i: int) -> list[int]:
            # A connection of its own: the kernel spreads connections over the front ends.
            with grpc.insecure_channel(cluster.procs.address, OWN_CONNECTION) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return [t for c in stub.Generate(greedy_request(prompts[i], MAX_TOKENS),
                                                 timeout=300) for t in c.token_ids]

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(one, range(len(prompts))))
        check_outputs(outputs, references, "through two front ends")
        frontends = info(cluster).frontends
        assert [f.index for f in frontends] == [0, 1]
        assert sum(f.num_requests_total for f in frontends) >= len(prompts)
        assert all(f.num_requests_total > 0 for f in frontends), frontends

        # Abort by id, asked on fresh connections (each may land on either front end): the
        # request ends wherever it runs.
        for k in range(4):
            request_id = f"long-{k}"
            stream = cluster.stub.Generate(greedy_request(prompts[k], 2000, request_id),
                                           timeout=120)
            first = next(stream)
            assert first.token_ids
            with grpc.insecure_channel(cluster.procs.address, OWN_CONNECTION) as channel:
                found = generation_pb2_grpc.GenerationStub(channel).Abort(
                    generation_pb2.AbortRequest(request_id=request_id), timeout=10).found
            assert found, request_id
            last = list(stream)[-1]
            assert last.finish_reason == "abort"
