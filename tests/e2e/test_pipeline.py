"""Pipeline parallelism across worker processes: every rank gets every StepInput, stages pass
hidden states + residual over torch.distributed (gloo), the scheduler ships sampled tokens to
the non-last ranks, and the outputs equal HF transformers (and so tp=pp=1) token for token."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import assert_matches_reference, greedy_request, run_cluster, stream_tokens

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("pp, scheduler_args", [
    (2, ["--max-num-batched-tokens", "64"]),    # chunked prefill, several chunks per prompt
    (4, ["--no-chunked-prefill"]),              # 30 layers on 4 stages: 8, 8, 7, 7
])
def test_pipeline_matches_hf(tmp_path: Path, prompts, references, pp: int,  # type: ignore[no-untyped-def]
                             scheduler_args: list[str]) -> None:
    with run_cluster(tmp_path, pp=pp, scheduler_args=scheduler_args) as cluster:
        info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest())
        ranks = sorted(w.pp_rank for w in info.replicas[0].workers)
        assert ranks == list(range(pp)) and info.replicas[0].state == "ready"
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(
                lambda p: stream_tokens(cluster.stub, greedy_request(p, MAX_TOKENS))[0],
                prompts[:8]))
        for i, (ours, ref) in enumerate(zip(outputs, references[:8])):
            assert_matches_reference(ours, *ref, label=f"pp={pp} prompt {i}")
        logs = cluster.logs()
        assert f"rank {pp - 1} of {pp}" in logs
