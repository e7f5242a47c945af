"""Worker fixtures: the default model's config and HF transformers on the same GGUF (the
oracle)."""

from pathlib import Path

import pytest
import torch

from services.model_config import ModelConfig, load_model_config
from tests.worker_svc.common import level_params
from worker_svc.kernels.cpu import CpuLevel


@pytest.fixture(scope="session")
def model_config(model_path: Path) -> ModelConfig:
    return load_model_config(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path: Path):  # type: ignore[no-untyped-def]
    """HF LlamaForCausalLM loaded from the same GGUF in float32 (slow: ~15 s, loaded once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(params=level_params())
def kernel_level(request: pytest.FixtureRequest) -> CpuLevel:
    """Each C-kernel level this CPU can run (forced, whatever the CPU's best)."""
    return request.param  # type: ignore[no-any-return]
