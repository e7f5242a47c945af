"""--quantization int8 across real processes (issue 39, point 3): the scheduler's flag reaches
the workers through their placement; a worker whose CPU level has an int8 matmul serves with
it, and one whose level has none refuses the placement with a log line that says why, instead
of quietly serving dense weights."""

from pathlib import Path

import pytest

from tests.e2e.harness import greedy_request, run_cluster, stream_tokens
from worker_svc.kernels.cpu import CpuLevel, detect_level
from worker_svc.kernels.gemm_int8 import int8_gemm

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(detect_level() < CpuLevel.AVX512_BF16 or int8_gemm(detect_level()) is None,
                    reason="this CPU has no int8 matmul level (AVX512-VNNI or AMX-INT8)")
def test_a_worker_serves_with_int8_matmuls(tmp_path: Path) -> None:
    with run_cluster(tmp_path, scheduler_args=("--quantization", "int8",
                                               "--kv-cache-dtype", "fp8")) as cluster:
        prompt = [(13 * i + 7) % 3000 + 40 for i in range(40)]
        tokens, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 6))
        assert len(tokens) == 6
        again, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 6))
        assert again == tokens


def test_a_level_without_int8_refuses_the_placement(tmp_path: Path) -> None:
    # The worker logs why and exits non-zero (the harness then reports its exit code and the
    # logs); the replica never comes up.
    with pytest.raises((RuntimeError, AssertionError)) as failed:
        with run_cluster(tmp_path, scheduler_args=("--quantization", "int8"),
                         worker_args=("--cpu-level", "avx2"), ready_timeout_s=40):
            pass
    logs = str(failed.value)
    assert "cannot serve this replica: --quantization int8 needs an int8 matmul kernel" in logs
    assert "CPU level avx2 has none" in logs
