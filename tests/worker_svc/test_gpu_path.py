"""The GPU worker's code paths, checked on a CPU: the Triton kernel set (under
TRITON_INTERPRET=1) against the C kernels and HF, decode steps through the padded persistent
buffers that CUDA graphs replay, and launching a step before the previous one's tokens are read.

A tiny random Llama (2 layers, GQA 2, head size 16) keeps the interpreter fast."""

import os

import torch

if not torch.cuda.is_available():      # before triton is imported anywhere in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from scripts.random_model import spread_weights  # noqa: E402
from services.model_config import load_model_config  # noqa: E402
from services.wire import NewRequest, RunningRequest, StepInput, StepOutput  # noqa: E402
from tests.worker_svc.common import GREEDY  # noqa: E402
from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes, padded_size  # noqa: E402
from worker_svc.pending_tokens import PENDING  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPTS = [[3, 17, 42, 9, 100, 5, 7], [8, 1, 2], [99, 98, 97, 96, 95, 94, 93, 92, 91],
           [11], [20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()   # no EOS: HF generates every token we do
    spread_weights(model)                     # diverse greedy tokens (scripts/random_model.py)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return path, model


def _runner(path: Path, kernels: str, dtype: torch.dtype = torch.float32,
            padded_decode: bool = False) -> ModelRunner:
    return ModelRunner(load_model_config(path), path, dtype, "w", kernels=kernels,
                       padded_decode=padded_decode)


def _greedy_steps(runner: ModelRunner, prompts: list[list[int]], num_new: int,
                  max_num_seqs: int = 8) -> list[list[int]]:
    """Prefill every prompt in one step, then decode all of them together `num_new` - 1
    times; returns each request's sampled tokens."""
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE, max_num_seqs)
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(prompts))]
    out = runner.execute(StepInput(0, [
        NewRequest(f"r{i}", p, len(p), GREEDY, [tables[i]], 0, len(p))
        for i, p in enumerate(prompts)], [], []))
    assert isinstance(out, StepOutput)
    tokens = [[t] for t in out.sampled_token_ids]
    for step in range(1, num_new):
        out = runner.execute(StepInput(step, [], [
            RunningRequest(f"r{i}", len(p) + step - 1, 1, [[]], []) for i, p in enumerate(prompts)
        ], []))
        assert isinstance(out, StepOutput)
        for i, t in enumerate(out.sampled_token_ids):
            tokens[i].append(t)
    return tokens


def _hf_tokens(hf_model, prompt: list[int], num_new: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256)[-3:] == [192, 224, 256]
    assert capture_sizes(10_000)[-1] == 512           # larger batches run eagerly
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 33, 64, 65)] == [1, 4, 8, 16, 48, 64,
                                                                        None]
    with pytest.raises(ValueError):
        capture_sizes(0)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(lambda ids, meta: (ids, ids), [1], 4, 4, torch.device("cpu"), capture=True)


def test_triton_kernel_set_matches_c_kernels_and_hf(tiny_model: tuple[Path, object]) -> None:
    # The GPU's layer code (Triton attention, KV write, norm, rotary, SiLU; torch matmuls)
    # run through the interpreter: the same greedy tokens as the C kernels and as HF.
    path, hf_model = tiny_model
    triton_tokens = _greedy_steps(_runner(path, "triton"), PROMPTS, 6)
    c_tokens = _greedy_steps(_runner(path, "c"), PROMPTS, 6)
    assert triton_tokens == c_tokens
    for prompt, tokens in zip(PROMPTS, triton_tokens, strict=True):
        assert tokens == _hf_tokens(hf_model, prompt, 6)


@pytest.mark.parametrize("kernels", ["c", "triton"])
def test_padded_decode_buffers_give_the_same_tokens(tiny_model: tuple[Path, object],
                                                    kernels: str) -> None:
    # 5 requests decode as a padded batch of 6 (sizes 1, 2, 4, 6), 3 as 4: padding rows
    # write the null block and their outputs are dropped. Same tokens as plain steps.
    path, _ = tiny_model
    plain = _greedy_steps(_runner(path, kernels), PROMPTS, 5, max_num_seqs=6)
    padded_runner = _runner(path, kernels, padded_decode=True)
    padded = _greedy_steps(padded_runner, PROMPTS, 5, max_num_seqs=6)
    assert padded_runner.graphs is not None and padded_runner.graphs.sizes == [1, 2, 4, 6]
    assert padded == plain
    three = _greedy_steps(padded_runner, PROMPTS[:3], 5, max_num_seqs=6)
    assert three == [tokens for tokens in plain[:3]]


def test_a_step_launched_before_the_last_one_is_read(tiny_model: tuple[Path, object]) -> None:
    # Async scheduling on a GPU: step n+1 is launched while step n's tokens are still on the
    # device (placeholders on the host); its decode inputs come from the device. Then step n
    # is finished. Same tokens as one step at a time.
    path, _ = tiny_model
    runner = _runner(path, "c")
    expected = _greedy_steps(runner, PROMPTS[:3], 5)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    prompts = PROMPTS[:3]
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(3)]
    pending = runner.launch(StepInput(0, [
        NewRequest(f"r{i}", p, len(p), GREEDY, [tables[i]], 0, len(p))
        for i, p in enumerate(prompts)], [], []))
    assert runner.input_batch is not None
    assert runner.input_batch.requests["r0"].token_ids[-1] == PENDING
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(1, 6):
        launched = None
        if step < 5:
            launched = runner.launch(StepInput(step, [], [
                RunningRequest(f"r{i}", len(p) + step - 1, 1, [[]], [])
                for i, p in enumerate(prompts)], []))
        out = runner.finish(pending)
        assert isinstance(out, StepOutput) and out.step_id == step - 1
        for i, t in enumerate(out.sampled_token_ids):
            tokens[i].append(t)
        pending = launched
    assert tokens == expected
    assert all(PENDING not in r.token_ids for r in runner.input_batch.requests.values())


def test_cpu_kv_budget_is_capped_and_logged(tiny_model: tuple[Path, object]) -> None:
    path, _ = tiny_model
    runner = _runner(path, "c")
    budget = runner.measure_kv_budget(BLOCK_SIZE, 2048, 256, cpu_cap_bytes=1 << 20)
    assert budget.device == "cpu" and budget.budget == 1 << 20      # the cap binds here
    assert budget.peak_activation > 0 and budget.weights == runner.weight_bytes
    assert budget.num_blocks(runner.kv_bytes_per_block(BLOCK_SIZE)) == \
        runner.num_blocks_for_budget(1 << 20, BLOCK_SIZE)
    assert "cap 0.00" in budget.describe() and "available" in budget.describe()


def test_float16_is_refused_on_the_cpu(tiny_model: tuple[Path, object]) -> None:
    path, _ = tiny_model
    with pytest.raises(ValueError, match="float16.*not supported on cpu"):
        _runner(path, "c", torch.float16)


@pytest.mark.parametrize("kernels", ["c", "triton"])
def test_the_profiling_forward_runs_the_largest_step(tiny_model: tuple[Path, object],
                                                     kernels: str) -> None:
    # What a GPU worker runs before sizing its KV cache (its peak memory is measured there):
    # 50 tokens over 8 new requests (lengths 6 and 7), logits for each, on a scratch cache
    # of 8 x 2 blocks plus the null block.
    from worker_svc.profile_step import profile_forward

    path, _ = tiny_model
    runner = _runner(path, kernels)
    specs = runner.kv_layer_specs(BLOCK_SIZE)
    assert profile_forward(runner.model, specs, 50, 8, BLOCK_SIZE) == \
        17 * runner.kv_bytes_per_block(BLOCK_SIZE)


def test_the_profiling_forward_samples_the_worst_case(tiny_model: tuple[Path, object],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The peak a GPU worker measures must include the sampler's worst case: every one of
    # max_num_seqs rows over the whole vocabulary with temperature, top-k, top-p past the
    # sampler's candidates (the full sort) and the most logprobs.
    from services.wire import MAX_TOP_LOGPROBS
    from worker_svc import profile_step, sampler

    calls = []
    sorts = []
    real_sample, real_sort = sampler.sample, torch.Tensor.sort

    def sample(logits, specs, generators, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((tuple(logits.shape), specs))
        return real_sample(logits, specs, generators, **kwargs)

    def sort(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        sorts.append(tuple(self.shape))
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(profile_step, "sample", sample)
    monkeypatch.setattr(torch.Tensor, "sort", sort)
    monkeypatch.setattr(sampler, "_TOP_P_CANDIDATES", 16)   # below the tiny vocabulary
    path, _ = tiny_model
    runner = _runner(path, "c")
    profile_step.profile_forward(runner.model, runner.kv_layer_specs(BLOCK_SIZE), 50, 8,
                                 BLOCK_SIZE)
    ((shape, specs),) = calls
    assert shape == (8, 128) and len(specs) == 8
    spec = specs[0]
    assert spec.temperature > 0 and spec.top_p < 1 and 0 < spec.top_k < 128
    assert spec.num_logprobs == MAX_TOP_LOGPROBS
    assert spec.min_p > 0 and spec.repetition_penalty != 1 and spec.presence_penalty
    assert (8, 128) in sorts, "top-p did not rank the whole vocabulary"
