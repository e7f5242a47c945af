"""Each family's config.json read as transformers 5.23 reads it (per-layer windows derived by
HF's own config classes, RoPE in both spellings, biases, q/k norm), GGUF families from their
tensors, and what the loader does not compute refused by name."""

import json
from pathlib import Path

import numpy as np
import pytest

from scripts.random_family import family_config
from services.model_config import ModelFormatError, RopeScaling, load_model_config
from tests.services.test_model_config import write_gguf


def hf_dir(tmp_path: Path, family: str, num_layers: int = 4, **changes: object) -> Path:
    path = tmp_path / family
    path.mkdir()
    config = family_config(family, num_layers, **changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_windows(family: str, num_layers: int, **changes: object) -> tuple[int, ...]:
    """The window each layer of transformers' model gets (0: full)."""
    from transformers import AutoConfig

    config = {k: v for k, v in family_config(family, num_layers, **changes).items()
              if k != "architectures"}
    cfg = AutoConfig.for_model(**config)
    if family == "mistral":
        return (cfg.sliding_window or 0,) * num_layers
    return tuple(cfg.sliding_window if kind == "sliding_attention" else 0
                 for kind in cfg.layer_types)


@pytest.mark.parametrize("family, changes", [
    ("mistral", {"sliding_window": 64}),
    ("mistral", {"sliding_window": None}),
    ("mistral", {"sliding_window": 4096}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32,
               "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 28}),
], ids=str)
def test_layer_windows_are_hf_own(tmp_path: Path, family: str,
                                  changes: dict[str, object]) -> None:
    ours = load_model_config(hf_dir(tmp_path, family, **changes)).layer_windows
    assert ours == hf_windows(family, 4, **changes)


def test_mistral_without_the_key_gets_hf_default_window(tmp_path: Path) -> None:
    path = hf_dir(tmp_path, "mistral")
    config = json.loads((path / "config.json").read_text())
    del config["sliding_window"]
    (path / "config.json").write_text(json.dumps(config))
    assert load_model_config(path).layer_windows == (4096,) * 4


def test_family_flags(tmp_path: Path) -> None:
    flags = {}
    for family, changes in [("llama", {"attention_bias": True}), ("qwen2", {}), ("qwen3", {}),
                            ("mistral", {})]:
        cfg = load_model_config(hf_dir(tmp_path, family, **changes))
        flags[family] = (cfg.architecture, cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm,
                         cfg.head_dim)
    assert flags == {"llama": ("llama", True, True, False, 16),
                     "qwen2": ("qwen2", True, False, False, 16),
                     "qwen3": ("qwen3", False, False, True, 32),
                     "mistral": ("mistral", False, False, False, 16)}


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes", [
    {"rope_scaling": {"rope_type": "llama3", **LLAMA3}, "rope_theta": 5e5},
    {"rope_scaling": {"type": "llama3", **LLAMA3}, "rope_theta": 5e5},
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}},
], ids=["rope_scaling", "rope_scaling-type", "rope_parameters"])
def test_both_rope_spellings_read_the_same(tmp_path: Path, changes: dict[str, object]) -> None:
    cfg = load_model_config(hf_dir(tmp_path, "llama", **{"rope_theta": None, **changes}))
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == RopeScaling("llama3", **LLAMA3)  # type: ignore[arg-type]


def test_yarn_defaults_its_original_length_to_the_context(tmp_path: Path) -> None:
    cfg = load_model_config(hf_dir(tmp_path, "qwen2", rope_scaling={"type": "yarn",
                                                                     "factor": 4.0}))
    assert cfg.rope_scaling == RopeScaling("yarn", factor=4.0,
                                           original_max_position_embeddings=512)


@pytest.mark.parametrize("family, changes, named", [
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("qwen2", {"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ("llama", {"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     "rope_scaling.low_freq_factor"),
    ("llama", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("llama", {"some_new_flag": True}, "some_new_flag"),
    ("llama", {"sliding_window": 64}, "sliding_window"),
    ("mistral", {"layer_types": ["full_attention"] * 4}, "layer_types"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("qwen2", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"layer_types": ["sliding_attention"] * 4}, "sliding_window is off"),
    ("qwen3", {"layer_types": ["full_attention"] * 3}, "layer_types"),
    ("qwen3", {"mlp_bias": True}, "mlp_bias"),
    ("gemma2", {}, "gemma2"),
])
def test_unimplemented_fields_are_refused_by_name(tmp_path: Path, family: str,
                                                  changes: dict[str, object],
                                                  named: str) -> None:
    path = tmp_path / "m"
    path.mkdir()
    base = family_config("llama" if family == "gemma2" else family, 4)
    (path / "config.json").write_text(json.dumps({
        **base, **changes, **({"model_type": "gemma2"} if family == "gemma2" else {})}))
    with pytest.raises(ModelFormatError, match=named):
        load_model_config(path)


# ------------------------------------------------------------------------------------------ GGUF


def qwen2_gguf(path: Path, extra: dict[str, int]) -> Path:
    """A 2-layer qwen2 GGUF (head_dim 4) with zero tensors, plus `extra` (name -> size)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen2")
    for key, value in {"context_length": 128, "embedding_length": 16, "block_count": 2,
                       "feed_forward_length": 32, "attention.head_count": 4,
                       "attention.head_count_kv": 2}.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    sizes = {"token_embd.weight": 4, "output_norm.weight": 4}
    sizes.update({f"blk.{i}.{n}.weight": 4 for i in range(2) for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_up",
        "ffn_down", "ffn_norm")})
    for name, size in {**sizes, **extra}.items():
        writer.add_tensor(name, np.full(size, 2.0, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_qwen2_gguf_biases_and_llama3_rope_freqs(tmp_path: Path) -> None:
    biases = {f"blk.{i}.attn_{p}.bias": 4 for i in range(2) for p in "qkv"}
    cfg = load_model_config(qwen2_gguf(tmp_path / "m.gguf",
                                       {"rope_freqs.weight": 2, **biases}))
    assert (cfg.architecture, cfg.attention_bias, cfg.o_proj_bias, cfg.qk_norm) == (
        "qwen2", True, False, False)
    assert cfg.rope_scaling == RopeScaling("freq_factors", freq_factors=(2.0, 2.0))


def test_yarn_gguf_metadata(tmp_path: Path) -> None:
    def edit(w) -> None:  # type: ignore[no-untyped-def]
        w.add_string("llama.rope.scaling.type", "yarn")
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)

    cfg = load_model_config(write_gguf(tmp_path / "m.gguf", edit))
    assert cfg.rope_scaling == RopeScaling("yarn", factor=4.0,
                                           original_max_position_embeddings=32)


@pytest.mark.parametrize("tensors, named", [
    (("rope_freqs.weight", "extra"), "rope_freqs.weight has"),
    (("blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"), "different"),
    (("blk.0.attn_q_norm.weight", "blk.1.attn_q_norm.weight"), "incomplete"),
])
def test_inconsistent_gguf_tensors_are_refused(tmp_path: Path, tensors: tuple[str, ...],
                                               named: str) -> None:
    extra = {name: 3 if name == "rope_freqs.weight" else 4 for name in tensors
             if name != "extra"}
    with pytest.raises(ModelFormatError, match=named):
        load_model_config(qwen2_gguf(tmp_path / "m.gguf", extra))
