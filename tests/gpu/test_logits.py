"""The logits check on the GPU (tests/gpu/logits.py): the services' logprobs against HF
transformers in fp32 with TF32 off on the same GPU and weights, after the prefill and after 32
decode steps. float32: every compared logprob within 1e-3; float16: within its stated
tolerance and the same top-1 outside near-ties at >= 99 % of positions. bfloat16 (and CUDA
graphs against eager, bitwise) is checked in test_cuda_graphs.py, on the clusters that test
starts anyway. One cluster at a time: a second worker on the same GPU would count the
first's memory as taken and fit no KV."""

from pathlib import Path

import pytest

from tests.gpu.cluster import device_under_test, gpu_cluster
from tests.gpu.logits import check_logits
from tests.gpu.oracle import CudaOracle

pytestmark = pytest.mark.gpu

NUM_PROMPTS = 8


def test_fp32_logits_match_hf(tmp_path: Path, model_path: Path, oracle: CudaOracle,
                              prompts: list[list[int]]) -> None:
    with gpu_cluster(tmp_path, model_path, dtype="float32") as cluster:
        check_logits(cluster, oracle.model, device_under_test(), prompts[:NUM_PROMPTS],
                     "float32")


def test_fp16_logits_and_top1_match_hf(tmp_path: Path, model_path: Path, oracle: CudaOracle,
                                       prompts: list[list[int]]) -> None:
    with gpu_cluster(tmp_path, model_path, dtype="float16") as cluster:
        check_logits(cluster, oracle.model, device_under_test(), prompts[:NUM_PROMPTS],
                     "float16")
