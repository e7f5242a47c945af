"""A worker over KV groups (services.kv_groups): its KV tensors are the group positions its
layers use (shared by the i-th layer of every group), sized by the group layout, and decode
steps through the padded graph buffers (a slot mapping and block table per group) give the
tokens of eager steps."""

from pathlib import Path

import pytest
import torch

from scripts.random_family import build_family_model
from services.kv_groups import KvGroupLayout
from services.model_config import load_model_config
from services.wire import NewRequest, RunningRequest, StepInput, StepOutput
from tests.worker_svc.common import GREEDY
from worker_svc.runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 200
# Gemma-like: two sliding layers, then a full one, twice: groups of 2, i.e. one full group and
# two sliding groups of two layers, sharing 2 KV tensors.
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
WINDOW = 8


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hybrid6")
    build_family_model(path, "qwen3", num_layers=6, use_sliding_window=True,
                       sliding_window=WINDOW, layer_types=LAYER_TYPES)
    return path


def test_layout_sizing_and_shared_tensors(hybrid: Path) -> None:
    config = load_model_config(hybrid)
    layout = KvGroupLayout.from_windows(config.layer_windows)
    assert layout.windows == (0, WINDOW, WINDOW) and layout.group_size == 2
    runner = ModelRunner(config, hybrid, torch.float32, "w")
    page = runner.kv_layer_specs(BLOCK_SIZE)[0].page_bytes
    assert runner.kv_positions == (0, 1)
    assert runner.kv_bytes_per_block(BLOCK_SIZE) == 2 * page        # not 6 pages
    assert runner.num_blocks_for_budget(50 * 2 * page + page, BLOCK_SIZE) == 50
    assert "3 KV group(s)" in runner.describe_kv() and "2 KV tensor(s)" in runner.describe_kv()
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert len(runner.kv_caches) == 6 and len({id(c) for c in runner.kv_caches}) == 2
    by_position: dict[int, torch.Tensor] = {}
    for layer, cache in enumerate(runner.kv_caches):
        assert by_position.setdefault(layout.position_of(layer), cache) is cache
    # A second stage holding layers 4 and 5 (one of each kind, both at position 1) splits
    # the groups: it holds one tensor, so a block costs it one page.
    stage = ModelRunner(config, hybrid, torch.float32, "w", first_layer=4, end_layer=6)
    assert stage.kv_positions == (1,)
    assert stage.kv_bytes_per_block(BLOCK_SIZE) == page
    stage.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert len(stage.kv_caches) == 2 and stage.kv_caches[0] is stage.kv_caches[1]


def _tokens(runner: ModelRunner, num_new: int) -> list[list[int]]:
    """Three prompts longer than the window, prefilled in one step, then decoded together:
    one table per group each, distinct blocks."""
    groups = runner.model.kv_layout.num_groups
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE, max_num_seqs=4)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (21, 9, 14)]
    per = -(-(max(map(len, prompts)) + num_new) // BLOCK_SIZE)
    tables = [[list(range(1 + (i * groups + g) * per, 1 + (i * groups + g + 1) * per))
               for g in range(groups)] for i in range(len(prompts))]
    none = [[] for _ in range(groups)]
    out = runner.execute(StepInput(0, [NewRequest(f"r{i}", p, len(p), GREEDY, tables[i], 0,
                                                  len(p)) for i, p in enumerate(prompts)],
                                   [], []))
    assert isinstance(out, StepOutput)
    tokens = [[t] for t in out.sampled_token_ids]
    for step in range(1, num_new):
        out = runner.execute(StepInput(step, [], [
            RunningRequest(f"r{i}", len(p) + step - 1, 1, none, [])
            for i, p in enumerate(prompts)], []))
        assert isinstance(out, StepOutput)
        for i, t in enumerate(out.sampled_token_ids):
            tokens[i].append(t)
    return tokens


def test_decode_through_per_group_graph_buffers_matches_eager(hybrid: Path) -> None:
    config = load_model_config(hybrid)
    eager = _tokens(ModelRunner(config, hybrid, torch.float32, "w", kernels="c"), 12)
    padded = ModelRunner(config, hybrid, torch.float32, "w", kernels="c", padded_decode=True)
    assert _tokens(padded, 12) == eager
    graphs = padded.graphs
    assert graphs is not None and len(graphs.slot_mappings) == len(graphs.block_tables) == 3
    # The groups' tables differ in the buffers: each row's own blocks per group.
    assert not torch.equal(graphs.block_tables[0][:3], graphs.block_tables[1][:3])
    assert len({t for tokens in eager for t in tokens}) >= 6      # the check can see a change


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_over_kv_groups_gives_the_torch_paths_tokens(hybrid: Path, kv: str) -> None:
    """Sliding-window and full groups sharing 8-bit KV tensors (issue 39): the C kernels'
    tokens are the torch twin's, both reading the same stored bytes; the pages are a quarter
    of float32's."""
    config = load_model_config(hybrid)
    kernel = ModelRunner(config, hybrid, torch.float32, "w", kernels="c", kv_cache_dtype=kv)
    twin = ModelRunner(config, hybrid, torch.float32, "w", kernels="torch", kv_cache_dtype=kv)
    dense = ModelRunner(config, hybrid, torch.float32, "w")
    assert 4 * kernel.kv_bytes_per_block(BLOCK_SIZE) == dense.kv_bytes_per_block(BLOCK_SIZE)
    assert kernel.model.kernels.attention is not None
    assert _tokens(kernel, 12) == _tokens(twin, 12)
    assert all(cache.dtype == kernel.kv_dtype for cache in kernel.kv_caches)
