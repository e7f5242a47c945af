"""The same greedy outputs under other batching regimes: chunked prefill off, a token budget
small enough to force many chunks, forced preemption through a tiny KV pool, and synchronous
and async scheduling."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import (
    RunningCluster,
    assert_matches_reference,
    greedy_request,
    run_cluster,
    stream_tokens,
)

pytestmark = pytest.mark.e2e


def check_all(cluster: RunningCluster, prompts, references) -> list[str]:  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_tokens, cluster.stub, greedy_request(p, MAX_TOKENS))
                   for p in prompts]
        outputs = [f.result()[0] for f in futures]
    return [assert_matches_reference(o, *r, label=f"prompt {i}")
            for i, (o, r) in enumerate(zip(outputs, references))]


def replica_info(cluster: RunningCluster) -> generation_pb2.ReplicaInfo:
    return cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest()).replicas[0]


def test_chunked_prefill_off(tmp_path: Path, prompts, references) -> None:  # type: ignore[no-untyped-def]
    with run_cluster(tmp_path, scheduler_args=["--no-chunked-prefill",
                                               "--max-num-batched-tokens", "64"]) as cluster:
        info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest())
        assert not info.chunked_prefill
        check_all(cluster, prompts, references)
        # A prompt longer than the flag's budget still runs whole (the budget grows to the
        # context length without chunking, as in vLLM), and matches.
        ids, _, _ = stream_tokens(cluster.stub, greedy_request(prompts[7], MAX_TOKENS))
        assert_matches_reference(ids, *references[7], label="long prompt, unchunked")


def test_many_chunks_with_tiny_token_budget(tmp_path: Path, prompts, references) -> None:  # type: ignore[no-untyped-def]
    # 7 tokens per step: every ~30-40 token prompt is spread over 5-6 steps, and concurrent
    # prompts share steps with each other's chunks and with decodes.
    with run_cluster(tmp_path, scheduler_args=["--max-num-batched-tokens", "7",
                                               "--block-size", "4"]) as cluster:
        check_all(cluster, prompts[:8], references[:8])
        steps = replica_info(cluster).num_steps
        assert steps >= sum(len(p) for p in prompts[:8]) // 7, "prompts should be chunked"


# The GPU's step loop on this CPU: each step launched before the last one's tokens are read
# (worker_svc.runner), as a GPU worker runs under async scheduling.
LAUNCH_AHEAD = {"SPLITSERVE_OVERLAP_STEPS": "1"}


@pytest.mark.parametrize("mode", ["--async-scheduling", "--no-async-scheduling"])
def test_forced_preemption(tmp_path: Path, prompts, references, mode: str) -> None:  # type: ignore[no-untyped-def]
    # 16 requests of ~35 + 24 tokens need ~4 blocks of 16 each (64 in all); 21 usable blocks
    # force preemption by recompute while every request still fits alone.
    # Prefix caching stays on: a resumed request may find its own freed blocks still cached.
    # Async runs the workers' launch-ahead loop too (preempted requests with tokens in flight).
    env = LAUNCH_AHEAD if mode == "--async-scheduling" else None
    with run_cluster(tmp_path, scheduler_args=["--num-kv-blocks", "22", mode],
                     env=env) as cluster:
        check_all(cluster, prompts, references)
        info = replica_info(cluster)
        assert info.num_kv_blocks == 22
        assert info.num_preemptions > 0, "the tiny pool should have forced preemption"


@pytest.mark.parametrize("mode", ["--async-scheduling", "--no-async-scheduling",
                                  "launch-ahead"])
def test_sync_and_async_scheduling_match(tmp_path: Path, prompts, references, mode: str) -> None:  # type: ignore[no-untyped-def]
    # Async is the default with one pipeline stage; both modes give the reference outputs,
    # and so does async with the workers' launch-ahead loop (a GPU worker's default), there
    # with client streams that send 4 tokens a message (--stream-interval).
    env = LAUNCH_AHEAD if mode == "launch-ahead" else None
    args = ["--async-scheduling", "--stream-interval", "4"] if mode == "launch-ahead" else [mode]
    with run_cluster(tmp_path, scheduler_args=args, env=env) as cluster:
        check_all(cluster, prompts, references)
        if mode == "launch-ahead":
            request = greedy_request(prompts[1], 18)
            chunks = list(cluster.stub.Generate(request, timeout=60))
            sizes = [len(c.token_ids) for c in chunks]
            assert sizes[0] == 1 and sum(sizes) == 18, sizes      # first token at once
            assert all(n >= 4 for n in sizes[1:-1]) and len(chunks) <= 6, sizes
            once = cluster.stub.GenerateOnce(request, timeout=60)
            assert [t for c in chunks for t in c.token_ids] == list(once.token_ids)
            assert "".join(c.text for c in chunks) == once.text
        # Stopping at EOS (async: the token computed one step ahead is dropped, not
        # streamed).
        r = greedy_request(prompts[0], 200)
        r.sampling.ignore_eos = False
        ids, _, last = stream_tokens(cluster.stub, r)
        assert last.finish_reason == "stop" and ids[-1] == 2
        assert last.usage.completion_tokens == len(ids)
