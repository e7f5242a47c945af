"""Tensor and pipeline parallelism across worker processes: every rank gets every StepInput,
TP ranks all-reduce over gloo, stages pass hidden states + residual over torch.distributed, the
scheduler ships sampled tokens to the non-last ranks, and the outputs equal HF transformers
(which the tp=pp=1 cluster matches in test_generation) token for token."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import assert_matches_reference, greedy_request, run_cluster, stream_tokens

pytestmark = pytest.mark.e2e


CHUNKED = ["--max-num-batched-tokens", "64"]      # several prefill chunks per prompt
UNCHUNKED = ["--no-chunked-prefill"]


@pytest.mark.parametrize("tp, pp, scheduler_args", [
    # Both prefill modes at pp=2 and tp=2; the deeper and wider shapes once each (the modes
    # differ in what the scheduler plans, which pp=2 and tp=2 already cover).
    (1, 2, CHUNKED), (1, 2, UNCHUNKED),
    (1, 3, CHUNKED),
    (1, 4, UNCHUNKED),                          # 30 layers on 4 stages: 8, 8, 7, 7
    (2, 1, CHUNKED), (2, 1, UNCHUNKED),         # 9 heads / 3 KV heads: 6+3 heads per rank
    (2, 2, CHUNKED),                            # four worker processes
], ids=lambda v: "chunked" if v is CHUNKED else "unchunked" if v is UNCHUNKED else str(v))
def test_parallel_matches_hf(tmp_path: Path, prompts, references, tp: int,  # type: ignore[no-untyped-def]
                             pp: int, scheduler_args: list[str]) -> None:
    with run_cluster(tmp_path, tp=tp, pp=pp, scheduler_args=scheduler_args) as cluster:
        info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest())
        ranks = sorted((w.pp_rank, w.tp_rank) for w in info.replicas[0].workers)
        assert ranks == [(p, t) for p in range(pp) for t in range(tp)]
        assert info.replicas[0].state == "ready"
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(
                lambda p: stream_tokens(cluster.stub, greedy_request(p, MAX_TOKENS))[0],
                prompts[:8]))
        for i, (ours, ref) in enumerate(zip(outputs, references[:8])):
            assert_matches_reference(ours, *ref, label=f"tp={tp} pp={pp} prompt {i}")
        logs = cluster.logs()
        assert f"rank {tp * pp - 1} of {tp * pp}" in logs
        if tp > 1:
            assert "holds query heads [6, 9), KV heads [2, 3)" in logs
