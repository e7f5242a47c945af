"""The Llama model on the real GGUF against HF transformers on the same file."""

from pathlib import Path

import pytest
import torch

from services.model_config import ModelConfig
from tests.worker_svc.common import PROMPTS, cpu_kernels, level_params
from worker_svc.attention import AttentionMetadata, build_attention_metadata
from worker_svc.kernels.cpu import CpuLevel
from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches
from worker_svc.model.llama import LlamaModel
from worker_svc.model.weights import ModelWeights, load_weights

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def fp32_weights(model_path: Path, model_config: ModelConfig) -> ModelWeights:
    return load_weights(model_path, model_config, torch.float32)


def _model(config: ModelConfig, weights: ModelWeights, first: int = 0,
           end: int | None = None, last: bool = True, level: CpuLevel | None = None
           ) -> LlamaModel:
    model = LlamaModel(config, torch.float32, first, end, last,
                       kernels=cpu_kernels(config, torch.float32, level))
    model.load_weights(weights)
    return model


def _block_tables() -> list[list[int]]:
    tables, next_block = [], 1
    for prompt in PROMPTS.values():
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    return tables


def _prefill_all(config: ModelConfig, num_layers: int, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """Every prompt as one prefill chunk of one flat batch."""
    prompts = list(PROMPTS.values())
    tables = _block_tables()
    num_blocks = tables[-1][-1] + 1
    meta = build_attention_metadata([len(p) for p in prompts], [0] * len(prompts), tables,
                                    BLOCK_SIZE, num_blocks)
    spec = KvLayerSpec(BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype)
    caches = allocate_kv_caches([spec] * num_layers, num_blocks)
    return torch.tensor([t for p in prompts for t in p]), meta, caches


@pytest.mark.parametrize("level", level_params(with_none=True))
def test_logits_match_hf(model_config: ModelConfig, fp32_weights: ModelWeights,
                         hf_model, level: CpuLevel) -> None:  # type: ignore[no-untyped-def]
    model = _model(model_config, fp32_weights, level=level)
    with_kernels = level is not CpuLevel.NONE
    assert (model.kernels.attention is not None) == with_kernels
    assert (model.kernels.elementwise is not None) == with_kernels
    input_ids, meta, caches = _prefill_all(model_config, model_config.num_layers)
    with torch.inference_mode():
        hidden, residual = model.forward(input_ids, None, None, meta.positions, meta, caches)
        logits = model.compute_logits(hidden, residual)       # [all prompt tokens, vocab]
        row = 0
        for prompt in PROMPTS.values():
            expected = hf_model(torch.tensor([prompt])).logits[0]
            ours = logits[row:row + len(prompt)]
            torch.testing.assert_close(ours, expected, atol=5e-4, rtol=0)
            assert ours.argmax(dim=-1).tolist() == expected.argmax(dim=-1).tolist()
            row += len(prompt)


def test_pipeline_stages_compose_to_the_whole_model(
        model_config: ModelConfig, fp32_weights: ModelWeights) -> None:
    whole = _model(model_config, fp32_weights)
    first = _model(model_config, fp32_weights, 0, 11, last=False)
    second = _model(model_config, fp32_weights, 11, None, last=True)
    assert first.lm_head is None and second.embed_tokens is None
    input_ids, meta, caches = _prefill_all(model_config, model_config.num_layers)
    with torch.inference_mode():
        expected = whole.compute_logits(*whole.forward(input_ids, None, None, meta.positions,
                                                       meta, caches))
        _, meta, caches = _prefill_all(model_config, model_config.num_layers)
        hidden, residual = first.forward(input_ids, None, None, meta.positions, meta,
                                         caches[:11])
        hidden, residual = second.forward(None, hidden, residual, meta.positions, meta,
                                          caches[11:])
        torch.testing.assert_close(second.compute_logits(hidden, residual), expected,
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("level", level_params(with_none=True))
def test_bfloat16_agrees_with_float32_where_clear(
        model_path: Path, model_config: ModelConfig, fp32_weights: ModelWeights,
        level: CpuLevel) -> None:
    # bfloat16 runs at every level: natively (avx512_bf16), else computed in float32.
    fp32 = _model(model_config, fp32_weights)
    bf16 = LlamaModel(model_config, torch.bfloat16,
                      kernels=cpu_kernels(model_config, torch.bfloat16, level))
    bf16.load_weights(ModelWeights({n: t.bfloat16() for n, t in fp32_weights.tensors.items()}))
    input_ids, meta, caches = _prefill_all(model_config, model_config.num_layers)
    _, _, bf16_caches = _prefill_all(model_config, model_config.num_layers, torch.bfloat16)
    with torch.inference_mode():
        expected = fp32.compute_logits(*fp32.forward(input_ids, None, None, meta.positions,
                                                     meta, caches))
        ours = bf16.compute_logits(*bf16.forward(input_ids, None, None, meta.positions, meta,
                                                 bf16_caches)).float()
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() > 10
    assert torch.equal(ours.argmax(-1)[clear], expected.argmax(-1)[clear])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_steps_on_quantized_blocks_agree_with_float32(
        model_path: Path, model_config: ModelConfig, fp32_weights: ModelWeights,
        dtype: torch.dtype) -> None:
    # Every prompt in chunks of at most 4 tokens: every matmul takes the small-step kernel on
    # the GGUF's own blocks (Q4_1 layers, the Q8_0 tied head).
    ours = LlamaModel(model_config, dtype, kernels=cpu_kernels(model_config, dtype))
    ours.load_weights(load_weights(model_path, model_config, dtype))
    if ours.kernels.quant:
        assert ours.layers[0].qkv_proj.quant_max_rows >= 4
        assert ours.lm_head.quant is not None or not dtype == torch.float32
    fp32 = _model(model_config, fp32_weights, level=CpuLevel.NONE)
    input_ids, meta, caches = _prefill_all(model_config, model_config.num_layers)
    with torch.inference_mode():
        expected = fp32.compute_logits(*fp32.forward(input_ids, None, None, meta.positions,
                                                     meta, caches))
        _, _, our_caches = _prefill_all(model_config, model_config.num_layers, dtype)
        rows = []
        for table, prompt in zip(_block_tables(), PROMPTS.values()):
            for start in range(0, len(prompt), 4):
                chunk = prompt[start:start + 4]
                step = build_attention_metadata([len(chunk)], [start], [table], BLOCK_SIZE,
                                                len(our_caches[0][0]))
                rows.append(ours.compute_logits(*ours.forward(
                    torch.tensor(chunk), None, None, step.positions, step, our_caches)))
        got = torch.cat(rows).float()
    if dtype == torch.float32:   # the same weights, exactly: only the sums' order differs
        torch.testing.assert_close(got, expected, atol=5e-4, rtol=0)
        return
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert clear.sum() > 10
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
