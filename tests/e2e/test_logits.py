"""The GPU run's logits check (tests/gpu/logits.py), on the CPU in float32 so CI runs it: the
services (real processes, C kernels) against HF transformers in fp32 on the same random
SmolLM2-shape weights (2 layers, diverse greedy output), every returned logprob within 1e-3
after the prefill and after 32 decode steps. The same code compares CUDA workers on a GPU
(tests/gpu/test_logits.py)."""

from pathlib import Path

import pytest
import torch

from scripts.random_model import build_model
from tests.gpu.cluster import gpu_cluster
from tests.gpu.logits import check_logits
from tests.gpu.oracle import CudaOracle


@pytest.fixture(scope="module")
def random_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "smollm2-2", "smollm2",
                       num_layers=2, dtype="float32")


def test_fp32_logits_through_the_services_match_hf_on_the_cpu(
        tmp_path: Path, random_smollm2: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (9, 40)]
    oracle = CudaOracle(random_smollm2, "cpu")
    with gpu_cluster(tmp_path, random_smollm2, device="cpu") as cluster:
        result = check_logits(cluster, oracle.model, "cpu", prompts, "float32")
    assert result.num_positions == 2 * 33
    assert result.num_agree == result.num_positions      # fp32: the same greedy tokens
