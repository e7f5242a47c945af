"""The step path on a running cluster: an idle replica costs no CPU, and a step the worker
fails ends only its own requests (the worker's test-only fault injection, switched on by
SPLITSERVE_TEST_FAIL_REQUEST_PREFIX, makes steps holding a "bad-" request raise)."""

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import (
    RunningCluster,
    assert_matches_reference,
    greedy_request,
    run_cluster,
    stream_tokens,
    wait_for,
)

pytestmark = pytest.mark.e2e

IDLE_WINDOW_S = 5.0
MAX_IDLE_CPU = 0.05          # of one core


@pytest.fixture(scope="module")
def faulty_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    # One request runs at a time, so a failing step holds the bad request alone and the others
    # wait their turn: each of them must then complete, and match.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPLITSERVE_TEST_FAIL_REQUEST_PREFIX", "bad-")
        with run_cluster(tmp_path_factory.mktemp("faulty"),
                         scheduler_args=["--max-num-seqs", "1"]) as running:
            yield running


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def info(cluster: RunningCluster) -> generation_pb2.ServerInfoResponse:
    return cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)


def test_idle_services_use_no_cpu_after_a_request(faulty_cluster, prompts) -> None:  # type: ignore[no-untyped-def]
    cluster = faulty_cluster
    _, _, last = stream_tokens(cluster.stub, greedy_request(prompts[1], 8))
    assert last.finish_reason == "length"
    time.sleep(1.0)                # the plan that frees the request's blocks
    pids = {name: proc.pid for name, proc in cluster.procs.procs.items()}
    num_plans = cluster.kv_stats().num_plans
    start = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(IDLE_WINDOW_S)
    used = {name: (cpu_seconds(pid) - start[name]) / IDLE_WINDOW_S
            for name, pid in pids.items()}
    # Before: the scheduler sent kvcache_svc an empty plan every ~2 ms until the next request
    # (about 10% and 7% of a core).
    assert cluster.kv_stats().num_plans == num_plans
    assert all(share < MAX_IDLE_CPU for share in used.values()), used


def test_failed_step_fails_its_request_and_the_others_complete(  # type: ignore[no-untyped-def]
        faulty_cluster, prompts, oracle) -> None:
    cluster = faulty_cluster
    before = info(cluster)
    good = prompts[:3]
    with ThreadPoolExecutor(1 + len(good)) as pool:
        # bad has good[0]'s prompt: if its prefill's blocks stayed indexed without their KV,
        # good[0] would read them (the scheduler empties the index instead).
        bad = pool.submit(stream_tokens, cluster.stub,
                          greedy_request(good[0], MAX_TOKENS, request_id="bad-1"))
        time.sleep(0.05)
        futures = [pool.submit(stream_tokens, cluster.stub,
                               greedy_request(p, MAX_TOKENS, request_id=f"ok-{i}"))
                   for i, p in enumerate(good)]
        with pytest.raises(grpc.RpcError) as caught:
            bad.result()
        # A fault of the server, not a lost replica: INTERNAL.
        assert caught.value.code() is grpc.StatusCode.INTERNAL
        assert "injected fault" in caught.value.details()
        for i, future in enumerate(futures):
            ids, _, last = future.result()
            assert last.finish_reason == "length"
            assert_matches_reference(ids, *oracle.greedy(good[i], MAX_TOKENS), label=f"ok-{i}")
    # The same replica, with the same worker, served them: nothing was lost or moved.
    after = info(cluster)
    assert ready_members(after) == ready_members(before) and len(ready_members(after)) == 1
    assert after.num_migrations == before.num_migrations
    assert wait_for(lambda: all(p.num_used_blocks == 0 for p in cluster.kv_stats().pools), 5.0)


def ready_members(server: generation_pb2.ServerInfoResponse) -> dict[int, list[int]]:
    """Ready replicas and their workers' epochs (a slow start may have lost one already)."""
    return {r.replica_id: [w.epoch for w in r.workers]
            for r in server.replicas if r.state == "ready"}


def test_a_failed_pipeline_step_ends_its_request_and_the_replica_recovers(  # type: ignore[no-untyped-def]
        tmp_path: Path, prompts, references) -> None:
    # pp=2, every stage raises on a step holding a "bad-" request. Stage 0 fails before it
    # sends its activations: stage 1 learns so from the step's header instead of waiting in
    # its receive for the process group's timeout (60 s); the bad request ends INTERNAL, the
    # replica re-forms, and the next request completes and matches.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPLITSERVE_TEST_FAIL_REQUEST_PREFIX", "bad-")
        with run_cluster(tmp_path, pp=2, scheduler_args=["--max-num-seqs", "1"]) as cluster:
            with pytest.raises(grpc.RpcError) as failed:
                stream_tokens(cluster.stub, greedy_request(prompts[0], 8, request_id="bad-1"))
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            started = time.monotonic()
            ids, _, _ = stream_tokens(cluster.stub, greedy_request(prompts[1], MAX_TOKENS))
            assert time.monotonic() - started < 30, "the replica took the group timeout"
            assert_matches_reference(ids, *references[1], label="after the failed step")
            assert any("pipeline stage 0 failed this step" in log.read_text()
                       for log in cluster.log_dir.glob("*.log"))
