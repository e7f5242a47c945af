"""RoPE frequency rules (worker_svc/model/rope.py) against transformers' own, in float32:
the rotation speeds equal HF's `ROPE_INIT_FUNCTIONS` exactly, and the cos/sin tables HF's
rotary embedding at every position (yarn's attention factor included)."""

import pytest
import torch

from scripts.random_family import family_config
from services.model_config import RopeScaling
from worker_svc.model.rope import RotaryEmbedding, inverse_frequencies

HEAD_DIM = 16
RULES: dict[str, tuple[dict[str, object], RopeScaling | None]] = {
    "default": ({"rope_type": "default"}, None),
    "linear": ({"rope_type": "linear", "factor": 4.0}, RopeScaling("linear", 4.0)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               RopeScaling("llama3", 8.0, 64)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
             RopeScaling("yarn", 4.0, 128)),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                     "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                     "truncate": False},
                    RopeScaling("yarn", 40.0, 64, beta_fast=16, beta_slow=2, mscale=1.0,
                                mscale_all_dim=0.5, truncate=False)),
}


def hf_config(params: dict[str, object]):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    config = {k: v for k, v in family_config("llama").items() if k != "architectures"}
    config["rope_parameters"] = {**params, "rope_theta": 10000.0}
    return AutoConfig.for_model(**config)


@pytest.mark.parametrize("rule", list(RULES))
def test_frequencies_and_tables_equal_hf(rule: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params, scaling = RULES[rule]
    config = hf_config(params)
    ours, factor = inverse_frequencies(HEAD_DIM, 10000.0, scaling)
    if scaling is not None:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling.rope_type](config, None)
        assert torch.equal(ours, theirs)
        assert factor == their_factor
    table = RotaryEmbedding(HEAD_DIM, 10000.0, 512, torch.float32, scaling=scaling)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(table.cos, cos[0], rtol=0, atol=1e-6)
    half = HEAD_DIM // 2          # ours stores rotate_half's sign in the first half of sin
    torch.testing.assert_close(table.sin[:, half:], sin[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(-table.sin[:, :half], sin[0, :, :half], rtol=0, atol=1e-6)


def test_freq_factors_divide_each_frequency() -> None:
    plain, _ = inverse_frequencies(HEAD_DIM, 10000.0, None)
    factors = tuple(float(i + 1) for i in range(HEAD_DIM // 2))
    scaled, factor = inverse_frequencies(HEAD_DIM, 10000.0,
                                         RopeScaling("freq_factors", freq_factors=factors))
    assert torch.equal(scaled, plain / torch.tensor(factors)) and factor == 1.0
