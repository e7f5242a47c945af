"""Model configs that ask for computation splitserve does not do are refused, naming the field;
neutral values of those fields and harmless keys still load. Tiny config.json / GGUF files are
written on the fly."""

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from services.model_config import ModelFormatError, default_model_path, load_model_config

LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def hf_dir(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **changes}))
    return path


def test_plain_llama_config_loads(tmp_path: Path) -> None:
    cfg = load_model_config(hf_dir(tmp_path))
    assert (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads) == (2, 4, 2)


@pytest.mark.parametrize("changes", [
    {"rope_scaling": None},
    {"rope_scaling": {"rope_type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    {"use_sliding_window": False, "sliding_window": 4096},
    {"sliding_window": None},
    {"layer_types": ["full_attention", "full_attention"]},
    {"_name_or_path": "x", "transformers_version": "4.50.0", "torch_dtype": "bfloat16",
     "initializer_range": 0.02, "use_cache": True, "pad_token_id": 2, "pretraining_tp": 1,
     "attention_dropout": 0.0, "is_llama_config": True, "rope_interleaved": False,
     "transformers.js_config": {"dtype": "q4"}},
], ids=lambda c: ",".join(c))
def test_neutral_values_and_harmless_keys_load(tmp_path: Path, changes: dict[str, object]) -> None:
    load_model_config(hf_dir(tmp_path, **changes))


@pytest.mark.parametrize("changes, field", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters"),
    ({"rope_scaling": {**LLAMA3_ROPE, "extra": 1}}, "rope_scaling.extra"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_interleaved": True}, "rope_interleaved"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"num_local_experts": 8}, "num_local_experts"),
])
def test_behaviour_changing_fields_are_refused(tmp_path: Path, changes: dict[str, object],
                                               field: str) -> None:
    with pytest.raises(ModelFormatError, match=field):
        load_model_config(hf_dir(tmp_path, **changes))


# ------------------------------------------------------------------------------------------ GGUF


def write_gguf(path: Path, edit: Callable[..., None] = lambda w: None,
               extra_tensors: tuple[str, ...] = ()) -> Path:
    """A 2-layer llama GGUF with tiny float32 tensors; `edit(writer)` adds metadata."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(16)
    writer.add_block_count(2)
    writer.add_feed_forward_length(32)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(32)
    edit(writer)
    names = ["token_embd.weight", "output_norm.weight", *extra_tensors]
    names += [f"blk.{i}.{n}.weight" for i in range(2) for n in (
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_gate", "ffn_up",
        "ffn_down", "ffn_norm")]
    for name in names:
        writer.add_tensor(name, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_plain_gguf_loads(tmp_path: Path) -> None:
    cfg = load_model_config(write_gguf(tmp_path / "m.gguf"))
    assert (cfg.num_layers, cfg.head_dim, cfg.tie_word_embeddings) == (2, 4, True)


def test_default_model_still_loads() -> None:
    assert load_model_config(default_model_path()).num_layers == 30


def _neutral_rope(w) -> None:  # type: ignore[no-untyped-def]
    from gguf import RopeScalingType

    w.add_rope_scaling_type(RopeScalingType.NONE)
    w.add_key_length(4)
    w.add_value_length(4)
    w.add_expert_count(0)


def test_neutral_gguf_metadata_loads(tmp_path: Path) -> None:
    load_model_config(write_gguf(tmp_path / "m.gguf", _neutral_rope))


def _linear_rope(w) -> None:  # type: ignore[no-untyped-def]
    from gguf import RopeScalingType

    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)


@pytest.mark.parametrize("edit, tensors, field", [
    (lambda w: w.add_string("llama.rope.scaling.type", "longrope"), (),
     "llama.rope.scaling.type"),
    (lambda w: w.add_expert_count(8), (), "llama.expert_count"),
    (lambda w: w.add_sliding_window(4096), (), "llama.attention.sliding_window"),
    (lambda w: w.add_value_length(8), (), "llama.attention.value_length"),
    (lambda w: w.add_rope_dimension_count(2), (), "llama.rope.dimension_count"),
    (lambda w: w.add_uint32("llama.something_new", 1), (), "llama.something_new"),
    (lambda w: None, ("blk.0.attn_q.bias",), "bias"),
    (lambda w: None, ("blk.0.ffn_up.bias",), "blk.0.ffn_up.bias"),
    (lambda w: None, ("blk.2.attn_q.weight",), "blk.2.attn_q.weight"),
    (lambda w: w.add_type("adapter"), (), "general.type"),
])
def test_behaviour_changing_gguf_is_refused(tmp_path: Path, edit: Callable[..., None],
                                            tensors: tuple[str, ...], field: str) -> None:
    with pytest.raises(ModelFormatError, match=field.replace(".", r"\.")):
        load_model_config(write_gguf(tmp_path / "m.gguf", edit, tensors))


def test_linear_gguf_rope_scaling_loads(tmp_path: Path) -> None:
    cfg = load_model_config(write_gguf(tmp_path / "m.gguf", _linear_rope))
    assert cfg.rope_scaling is not None
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)
