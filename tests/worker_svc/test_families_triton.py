"""The families on the GPU's code path, checked on a CPU: the Triton kernel set (under
TRITON_INTERPRET=1, as tests/worker_svc/test_gpu_path.py) runs Qwen3's q/k norms and biases
and Llama 3's scaled RoPE tables, and a hybrid of sliding (window 16, shorter than the
longer prompt) and full layers, greedy token for token against HF in fp32."""

import os

import torch

if not torch.cuda.is_available():      # before triton is imported anywhere in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from scripts.random_family import build_family_model  # noqa: E402
from services.model_config import load_model_config  # noqa: E402
from tests.worker_svc.common import assert_greedy_match, hf_greedy  # noqa: E402
from tests.worker_svc.test_families import CASES, greedy_tokens  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

NUM_NEW_TOKENS = 4


@pytest.mark.parametrize("name", ["qwen3-bias", "llama3-rope", "hybrid"])
def test_triton_path_matches_hf(tmp_path: Path, name: str) -> None:
    family, num_layers, changes = CASES[name]
    model = build_family_model(tmp_path / name, family, num_layers=num_layers, **changes)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (40, 7)]
    config = load_model_config(tmp_path / name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runner = ModelRunner(config, tmp_path / name, torch.float32, "w", device=device,
                         kernels="triton")
    for ours, prompt in zip(greedy_tokens(runner, prompts, NUM_NEW_TOKENS), prompts,
                            strict=True):
        assert_greedy_match(ours, *hf_greedy(model, prompt, NUM_NEW_TOKENS))
