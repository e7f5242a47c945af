"""Every model family against HF transformers in fp32, greedy token for token: tiny random
models (scripts/random_family.py) driven through `ModelRunner` (prefill, then decode steps),
with the C kernels (the CPU default) and with the torch path forced. The windowed models'
window (16 tokens) is shorter than the longer prompt (48), in one prefill step and in chunks
that cross the window's edge. Every request has one block table per KV group (the hybrid's
three layers are three groups sharing one KV tensor); a sliding group's table may hold the
null block or blocks another request has since reused, before the window."""

import dataclasses
from pathlib import Path

import pytest
import torch

from scripts.random_family import build_family_model, write_gguf
from services.model_config import ModelConfig, load_model_config
from services.wire import NewRequest, RunningRequest, StepInput, StepOutput
from tests.worker_svc.common import GREEDY, assert_greedy_match, hf_greedy
from worker_svc.runner import ModelRunner

BLOCK_SIZE = 8
NUM_BLOCKS = 96
NUM_NEW_TOKENS = 10
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
HYBRID_TYPES = ["full_attention", "sliding_attention", "full_attention"]
WINDOW = 16       # shorter than the 48-token prompt: the windowed layers see a part of it

# name -> (family, number of layers, config.json changes)
CASES: dict[str, tuple[str, int, dict[str, object]]] = {
    "llama3-rope": ("llama", 2, {"rope_scaling": LLAMA3}),
    # transformers 5's spelling: theta inside rope_parameters
    "linear-rope": ("llama", 2, {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                     "rope_theta": 10000.0}}),
    "yarn-rope": ("llama", 2, {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 128}}),
    "llama-bias": ("llama", 2, {"attention_bias": True}),
    "qwen2": ("qwen2", 2, {}),
    "qwen3": ("qwen3", 2, {}),
    "qwen3-bias": ("qwen3", 2, {"attention_bias": True}),
    "mistral": ("mistral", 2, {"sliding_window": WINDOW}),
    "hybrid": ("qwen3", 3, {"use_sliding_window": True, "sliding_window": WINDOW,
                            "layer_types": HYBRID_TYPES}),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    """Two prompts, the longer one long enough (48) that llama3's slowed frequencies matter."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (48, 13)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """name -> (model directory, HF model, HF's greedy references), built on first use."""
    cache: dict[str, tuple[Path, object, list[tuple[list[int], list]]]] = {}

    def get(name: str) -> tuple[Path, object, list[tuple[list[int], list]]]:
        if name not in cache:
            family, num_layers, changes = CASES[name]
            path = tmp_path_factory.mktemp(name)
            model = build_family_model(path, family, num_layers=num_layers, **changes)
            cache[name] = (path, model, [hf_greedy(model, p, NUM_NEW_TOKENS)
                                         for p in _prompts(512)])
        return cache[name]

    return get


def block_tables(runner: ModelRunner, num_tokens: list[int], first_block: int = 1
                 ) -> list[list[list[int]]]:
    """Per request, one table per KV group of distinct blocks covering `num_tokens[i]`."""
    num_groups = runner.model.kv_layout.num_groups
    tables, next_block = [], first_block
    for n in num_tokens:
        need = -(-n // BLOCK_SIZE)
        tables.append([list(range(next_block + g * need, next_block + (g + 1) * need))
                       for g in range(num_groups)])
        next_block += num_groups * need
    assert next_block <= NUM_BLOCKS
    return tables


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], num_new: int,
                  first_chunk: int | None = None) -> list[list[int]]:
    """Prefill every prompt in one step (or `first_chunk` tokens of each, then the rest),
    then decode them together num_new - 1 times."""
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    tables = block_tables(runner, [len(p) + num_new for p in prompts])
    none = [[] for _ in range(runner.model.kv_layout.num_groups)]
    chunks = [min(len(p), first_chunk or len(p)) for p in prompts]
    out = runner.execute(StepInput(0, [
        NewRequest(f"r{i}", p, len(p), GREEDY, tables[i], 0, chunks[i])
        for i, p in enumerate(prompts)], [], []))
    assert isinstance(out, StepOutput)
    step = 1
    if first_chunk is not None:      # the rest of every prompt (0 tokens where it fit)
        rest = [(i, p) for i, p in enumerate(prompts) if chunks[i] < len(p)]
        out = runner.execute(StepInput(step, [], [
            RunningRequest(f"r{i}", chunks[i], len(p) - chunks[i], none, []) for i, p in rest],
            []))
        assert isinstance(out, StepOutput)
        assert len(rest) == len(prompts), "every prompt must be longer than first_chunk"
        step += 1
    tokens = [[t] for t in out.sampled_token_ids]
    for n in range(1, num_new):
        out = runner.execute(StepInput(step, [], [
            RunningRequest(f"r{i}", len(p) + n - 1, 1, none, [])
            for i, p in enumerate(prompts)], []))
        step += 1
        assert isinstance(out, StepOutput)
        for i, t in enumerate(out.sampled_token_ids):
            tokens[i].append(t)
    return tokens


def run(config: ModelConfig, path: Path, kernels: str) -> list[list[int]]:
    runner = ModelRunner(config, path, torch.float32, "w", kernels=kernels)
    return greedy_tokens(runner, _prompts(config.vocab_size), NUM_NEW_TOKENS)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_match_hf(built, name: str, kernels: str  # type: ignore[no-untyped-def]
                                ) -> None:
    path, _, references = built(name)
    config = load_model_config(path)
    assert config.architecture == CASES[name][0]
    # The check can see a wrong token: HF's own output is not one token repeated.
    assert len({t for reference, _ in references for t in reference}) >= 5, references
    for ours, (reference, near_tie) in zip(run(config, path, kernels), references,
                                           strict=True):
        assert_greedy_match(ours, reference, near_tie)


@pytest.mark.parametrize("name", ["llama3-rope", "yarn-rope", "qwen2", "qwen3"])
def test_leaving_the_variation_out_changes_the_tokens(built, name: str  # type: ignore[no-untyped-def]
                                                      ) -> None:
    """The checks above would notice a loader that ignored the family's variation."""
    path, _, references = built(name)
    config = load_model_config(path)
    plain = dataclasses.replace(config, rope_scaling=None, attention_bias=False,
                                qk_norm=False)
    assert plain != config
    ours = run(plain, path, "torch")
    assert [tokens[:NUM_NEW_TOKENS] for tokens in ours] != [r for r, _ in references]


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("name", ["mistral", "hybrid"])
def test_chunked_prefill_across_the_window_edge_matches_hf(
        built, name: str, kernels: str) -> None:  # type: ignore[no-untyped-def]
    """Prompts of 48 and 13 tokens prefilled 10 tokens first, then the rest: the second
    chunk's first rows read keys of the first chunk, its later rows' windows start inside
    it."""
    path, _, references = built(name)
    config = load_model_config(path)
    runner = ModelRunner(config, path, torch.float32, "w", kernels=kernels)
    ours = greedy_tokens(runner, _prompts(config.vocab_size), NUM_NEW_TOKENS, first_chunk=10)
    for tokens, (reference, near_tie) in zip(ours, references, strict=True):
        assert_greedy_match(tokens, reference, near_tie)


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("name", ["mistral", "hybrid"])
def test_blocks_before_the_window_may_be_null_or_reused_by_another_request(
        built, name: str, kernels: str) -> None:  # type: ignore[no-untyped-def]
    """What kvcache_svc's sliding groups do to a worker's tables, by hand: "a" prefills the
    48-token prompt; then, in one step with a's first decode, "b" (the 13-token prompt) is
    given the blocks a's sliding groups no longer read (kvcache_svc freed them) and writes its
    own KV there, while "c" (the 48-token prompt again) starts from a 40-token prefix hit
    whose sliding tables hold the null block, poisoned, before the window. All three decode
    on together and give HF's tokens. The C kernels read no block before a row's window: the
    null block holds NaN. The torch path also pads its gathers with the null block (masked
    out, so only a finite garbage is harmless: 0 * NaN is NaN); nothing writes NaN there."""
    path, _, references = built(name)
    config = load_model_config(path)
    runner = ModelRunner(config, path, torch.float32, "w", kernels=kernels)
    layout = runner.model.kv_layout
    assert any(g.is_sliding for g in layout.groups)
    if name == "hybrid":               # three groups of one layer: one tensor for all three
        assert layout.num_groups == 3 and len(runner.kv_positions) == 1
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    for cache in runner.kv_caches:     # the null block: garbage
        if kernels == "c":
            cache[:, 0] = float("nan")
        else:
            cache[:, 0] = 1e3 * torch.randn_like(cache[:, 0])
    long, short = _prompts(config.vocab_size)
    num_blocks = -(-(len(long) + NUM_NEW_TOKENS) // BLOCK_SIZE)       # 8 per group
    a_tables, b_fresh, c_fresh = block_tables(runner, [len(long) + NUM_NEW_TOKENS] * 3)
    # a's first decode (position 48) reads 33..48: blocks 0..3 of a sliding group are free.
    sliding = [g for g, group in enumerate(layout.groups) if group.is_sliding]
    b_tables = [a_tables[g][:3] if g in sliding else b_fresh[g][:3]
                for g in range(layout.num_groups)]
    # c: a 40-token hit, whose next query reads 25..40: a sliding group needs blocks 3 and 4.
    hit = 5
    c_tables = [([0] * 3 + a_tables[g][3:hit] if g in sliding else a_tables[g][:hit])
                + c_fresh[g][hit:num_blocks] for g in range(layout.num_groups)]
    none = [[] for _ in layout.groups]
    out = runner.execute(StepInput(0, [NewRequest("a", long, len(long), GREEDY, a_tables,
                                                  0, len(long))], [], []))
    assert isinstance(out, StepOutput)
    tokens = {"a": list(out.sampled_token_ids), "b": [], "c": []}
    running = [RunningRequest("a", len(long), 1, none, [])]
    new = [NewRequest("b", short, len(short), GREEDY, b_tables, 0, len(short)),
           NewRequest("c", long, len(long), GREEDY, c_tables, hit * BLOCK_SIZE,
                      len(long) - hit * BLOCK_SIZE)]
    lengths = {"a": len(long) + 1, "b": len(short), "c": len(long)}
    for step in range(1, NUM_NEW_TOKENS + 1):
        out = runner.execute(StepInput(step, new, running, []))
        assert isinstance(out, StepOutput)
        for rid, token in zip(out.request_ids, out.sampled_token_ids, strict=True):
            tokens[rid].append(token)
        new = []
        running = [RunningRequest(rid, lengths[rid], 1, none, []) for rid in lengths
                   if len(tokens[rid]) < NUM_NEW_TOKENS]
        for r in running:
            lengths[r.request_id] += 1
    for rid, (reference, near_tie) in (("a", references[0]), ("b", references[1]),
                                       ("c", references[0])):
        assert_greedy_match(tokens[rid], reference, near_tie)


@pytest.mark.parametrize("name", ["mistral", "hybrid"])
def test_the_window_changes_the_tokens(built, name: str) -> None:  # type: ignore[no-untyped-def]
    """The window checks above would notice a worker that attended past the window."""
    path, _, references = built(name)
    config = load_model_config(path)
    assert any(0 < w < 48 for w in config.layer_windows), config.layer_windows
    full = dataclasses.replace(config, layer_windows=(0,) * config.num_layers)
    ours = run(full, path, "c")
    assert [tokens[:NUM_NEW_TOKENS] for tokens in ours] != [r for r, _ in references]


def test_hf_sliding_mask_keeps_the_last_window_keys() -> None:
    """The convention ModelConfig.layer_windows documents: with window W the query at p sees
    keys p-W+1 .. p, as HF's sliding overlay (on top of its causal mask)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    window, query = 4, 10
    seen = [kv for kv in range(16) if sliding_window_overlay(window)(0, 0, query, kv)
            and causal_mask_function(0, 0, query, kv)]
    assert seen == list(range(query - window + 1, query + 1))


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama3-rope", "llama-bias"])
def test_gguf_of_the_same_weights_matches_hf(built, name: str,  # type: ignore[no-untyped-def]
                                             tmp_path: Path) -> None:
    """The same weights in llama.cpp's layout (scripts/random_family.py's `write_gguf`):
    qwen2/qwen3 unpermuted with biases / q-k norms, llama permuted with llama3's scaling as
    the rope_freqs tensor."""
    path, model, references = built(name)
    gguf = write_gguf(model, tmp_path / f"{name}.gguf")
    from_gguf, from_hf = load_model_config(gguf), load_model_config(path)
    same = ("architecture", "head_dim", "attention_bias", "o_proj_bias", "qk_norm",
            "layer_windows", "tie_word_embeddings", "max_model_len")
    assert [getattr(from_gguf, f) for f in same] == [getattr(from_hf, f) for f in same]
    if name == "llama3-rope":
        assert from_gguf.rope_scaling is not None
        assert from_gguf.rope_scaling.rope_type == "freq_factors"
    for ours, (reference, near_tie) in zip(run(from_gguf, gguf, "c"), references, strict=True):
        assert_greedy_match(ours, reference, near_tie)


def test_two_tp_ranks_slice_biases_and_share_qk_norms(tmp_path: Path) -> None:
    """Qwen3 with q/k/v/o biases on 2 TP ranks (real processes, gloo): each rank's biases are
    its heads' slice, the o_proj bias is added once after the all-reduce, the q/k norms are
    replicated; the ranks give the tokens of one rank."""
    import json
    import os

    import torch.multiprocessing as mp

    from tests.e2e.harness import free_ports
    from tests.worker_svc.test_tensor_parallel import BLOCK_SIZE as TP_BLOCK_SIZE
    from tests.worker_svc.test_tensor_parallel import NUM_BLOCKS as TP_NUM_BLOCKS
    from tests.worker_svc.test_tensor_parallel import _generate, _run_rank

    path = tmp_path / "qwen3"
    build_family_model(path, "qwen3", vocab_size=49152, attention_bias=True)  # PROMPTS' ids
    single = ModelRunner(load_model_config(path), path, torch.float32, "tp-none")
    single.init_cache(TP_NUM_BLOCKS, TP_BLOCK_SIZE)
    expected = _generate(single)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_run_rank, args=(2, free_ports(1)[0], str(path), str(tmp_path)),
                       nprocs=2, start_method="spawn")
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected, rank
