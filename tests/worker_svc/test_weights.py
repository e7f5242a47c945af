"""Weight loading: GGUF (dequantized, q/k rows un-permuted) and HF safetensors directories."""

from pathlib import Path

import pytest
import torch

from services.model_config import ModelConfig, load_model_config
from tests.worker_svc.common import cpu_kernels
from worker_svc.attention import build_attention_metadata
from worker_svc.kernels.quant_blocks import QUANT_BLOCK
from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches
from worker_svc.model.llama import LlamaModel
from worker_svc.model.weights import (
    ModelWeights,
    load_weights,
    unpermute_llama_cpp_rows,
)


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to attn_q / attn_k: per head, rows (i, i + d/2) become
    neighbours."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(
        rows, cols)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(24, 5)
    assert torch.equal(unpermute_llama_cpp_rows(llama_cpp_permute(weight, 3), 3), weight)
    # Head 0, GGUF rows 0 and 1 are HF rows 0 and 4 (head_dim 8).
    assert torch.equal(llama_cpp_permute(weight, 3)[1], weight[4])


@pytest.fixture(scope="module")
def gguf_weights(model_path: Path, model_config: ModelConfig) -> ModelWeights:
    return load_weights(model_path, model_config, torch.float32)


def test_gguf_weights_equal_hf_loader(gguf_weights: ModelWeights,
                                      hf_model) -> None:  # type: ignore[no-untyped-def]
    ours = gguf_weights.tensors
    theirs = dict(hf_model.named_parameters())
    assert "lm_head.weight" not in ours          # tied: the head is the embedding
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_gguf_quant_blocks_rebuild_the_dense_weights(gguf_weights: ModelWeights) -> None:
    # Every Q4_1 matrix of the file (all of the layers' matrices), q/k un-permuted like the
    # dense ones, and the Q8_0 embedding (the tied head): exactly gguf's dequantization.
    assert len(gguf_weights.quant) == 7 * 30 + 1
    for name, blocks in gguf_weights.quant.items():
        if name == "model.embed_tokens.weight":
            assert blocks.bits == 8 and blocks.values.dtype == torch.int8
            assert not blocks.offsets.any()
        else:
            assert blocks.bits == 4 and blocks.values.dtype == torch.uint8
            assert int(blocks.values.max()) <= 15
        scales = blocks.scales.repeat_interleave(QUANT_BLOCK, dim=1)
        offsets = blocks.offsets.repeat_interleave(QUANT_BLOCK, dim=1)
        rebuilt = scales * blocks.values.float() + offsets
        assert torch.equal(rebuilt, gguf_weights.tensors[name]), name


def test_gguf_stage_loads_only_its_layers(model_path: Path, model_config: ModelConfig) -> None:
    middle = load_weights(model_path, model_config, torch.bfloat16, first_layer=10,
                          end_layer=12, is_last_stage=False)
    assert {int(n.split(".")[2]) for n in middle.tensors} == {10, 11}
    assert set(middle.quant) < set(middle.tensors)
    assert all(t.dtype == torch.bfloat16 for t in middle.tensors.values())
    last = load_weights(model_path, model_config, torch.float32, first_layer=29).tensors
    assert {n for n in last if not n.startswith("model.layers.29.")} == {
        "model.embed_tokens.weight", "model.norm.weight"}  # tied head lives on the last stage
    with pytest.raises(ValueError, match="layer range"):
        load_weights(model_path, model_config, torch.float32, first_layer=5, end_layer=5)


def _tiny_hf_model(tmp_path: Path, tie: bool, max_shard_size: str | None):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    return model


def _our_logits(path: Path, config: ModelConfig, token_ids: list[int], first: int = 0,
                end: int | None = None) -> torch.Tensor:
    model = LlamaModel(config, torch.float32, kernels=cpu_kernels(config, torch.float32))
    weights = load_weights(path, config, torch.float32)
    assert not weights.quant
    model.load_weights(weights)
    spec = KvLayerSpec(4, config.num_kv_heads, config.head_dim, torch.float32)
    caches = allocate_kv_caches([spec] * config.num_layers, 16)
    meta = build_attention_metadata([len(token_ids)], [0], [list(range(1, 16))], 4, 16)
    with torch.inference_mode():
        hidden, residual = model.forward(torch.tensor(token_ids), None, None, meta.positions,
                                         meta, caches)
        return model.compute_logits(hidden, residual)


@pytest.mark.parametrize("tie,max_shard_size", [(True, None), (False, "60KB")])
def test_hf_directory_matches_transformers(tmp_path: Path, tie: bool,
                                           max_shard_size: str | None) -> None:
    hf = _tiny_hf_model(tmp_path, tie, max_shard_size)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    config = load_model_config(tmp_path)
    assert config.tie_word_embeddings == tie
    token_ids = [5, 17, 99, 3, 64, 127, 0, 42, 8]
    with torch.inference_mode():
        expected = hf(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(_our_logits(tmp_path, config, token_ids), expected,
                               atol=1e-5, rtol=1e-5)
