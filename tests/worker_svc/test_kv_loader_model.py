"""KvLoader end to end with the real ModelRunner (SmolLM2, CPU): a request loaded from the
store (whole chunks, or to the prompt's end through a partial last chunk) decodes the same
greedy tokens as the request that computed that KV, loaded in the background or layer by
layer (the rest computed in the load's step). Split from test_kv_loader.py."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zmq

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.kv_store_wire import KvSlice
from services.model_config import ModelConfig
from services.wire import NewRequest, RunningRequest, StepInput, StepOutput
from tests.kvcache_svc.kv_store.serving import client_codec, serving
from tests.worker_svc.common import GREEDY
from tests.worker_svc.test_kv_loader import drain, keys, tokens_of
from tests.worker_svc.test_runner import MiniScheduler
from worker_svc.kv_saver import KvStoreOptions
from worker_svc.runner import ModelRunner

E2E_BLOCK = 4
E2E_CHUNK = 32
E2E_PROMPT_LEN = 75            # 2 whole chunks: 64 tokens load, 11 computed
E2E_LOAD = 64
MAX_TOKENS = 4


@dataclass(frozen=True)
class Computed:
    prompt: list[int]
    expected: list[int]            # B's greedy tokens
    block_ids: list[int]           # B's blocks
    kv_slice: KvSlice              # the runner's part of the KV in the store


@contextmanager
def computed_by_b(ctx: zmq.Context, model_path: Path, model_config: ModelConfig,
                  kv_cache_dtype: str = "auto"
                  ) -> Iterator[tuple[ModelRunner, KvStore, Computed]]:
    """A runner saving to a real store, after request B computed a random prompt in two
    steps, split where C's load of whole chunks ends (so that C's computed tail runs exactly
    as B's did), and decoded; B's KV is in the store: 2 whole chunks and the tail [64, 75).
    `kv_cache_dtype`: the runner's --kv-cache-dtype."""
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, model_config.vocab_size, (E2E_PROMPT_LEN,),
                           generator=generator).tolist()
    store = KvStore([MemoryTier(256 << 20)], chunk_tokens=E2E_CHUNK)
    with serving(ctx, store) as loop:
        runner = ModelRunner(model_config, model_path, torch.float32, "worker-0",
                             kv_store=KvStoreOptions(loop.address, codec=client_codec()),
                             kv_cache_dtype=kv_cache_dtype)
        saver = runner.kv_saver
        try:
            assert saver is not None and saver.ready.wait(10)
            runner.init_cache(128, E2E_BLOCK)
            scheduler = MiniScheduler(token_budget=E2E_LOAD, send_tokens=False)
            scheduler.add("b", prompt, MAX_TOKENS)
            while scheduler.has_work:
                out = runner.execute(scheduler.schedule())
                assert isinstance(out, StepOutput)
                scheduler.update(out)
            drain(saver)
            assert saver.num_chunks_stored == 3
            yield runner, store, Computed(prompt, scheduler.outputs("b"),
                                          scheduler.requests["b"].block_ids, saver.kv_slice)
        finally:
            runner.close()


@pytest.mark.parametrize("num_load, kv_cache_dtype", [
    (E2E_LOAD, "auto"), (E2E_PROMPT_LEN - 1, "auto"), (E2E_LOAD, "fp8"),
    (E2E_PROMPT_LEN - 1, "fp8_e5m2")],
    ids=["whole-chunks", "all-but-the-last-token", "whole-chunks-fp8", "all-but-last-e5m2"])
def test_a_request_loaded_from_the_store_decodes_as_the_one_that_computed_it(
        ctx: zmq.Context, model_path: Path, model_config: ModelConfig, num_load: int,
        kv_cache_dtype: str) -> None:
    """C loads B's KV (whole chunks, or to the prompt's end through B's partial tail chunk:
    one token computed) and decodes B's tokens; with an 8-bit cache too, whose chunks carry
    its dtype and scales (the runner's KvSlice) and whose bytes load unchanged."""
    with computed_by_b(ctx, model_path, model_config, kv_cache_dtype) as (runner, store, b):
        if kv_cache_dtype != "auto":
            assert b.kv_slice.dtype == str(runner.kv_dtype).removeprefix("torch.")
            assert b.kv_slice.model.endswith("+k1v1")
            assert all(cache.dtype == runner.kv_dtype for cache in runner.kv_caches)
        prompt, expected, b_blocks = b.prompt, b.expected, b.block_ids
        c_blocks = list(range(80, 80 + -(-(E2E_PROMPT_LEN + MAX_TOKENS) // E2E_BLOCK)))
        num_load_blocks = -(-num_load // E2E_BLOCK)
        launched = runner.launch(StepInput(100, [NewRequest(
            "c", prompt, len(prompt), GREEDY, [c_blocks[:num_load_blocks]], 0, 0,
            num_load_tokens=num_load)], [], []))
        out = runner.finish(launched)
        assert isinstance(out, StepOutput) and out.request_ids == []
        assert launched.loads is not None and launched.loads.wait() == {"c": num_load}
        for cache in runner.kv_caches:
            raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
            assert torch.equal(tokens_of(raw, c_blocks, 0, num_load),
                               tokens_of(raw, b_blocks, 0, num_load))

        assert run_c(runner, c_blocks, num_load, num_load_blocks, []) == expected


@pytest.mark.parametrize("num_load, lost_chunk", [(E2E_LOAD, None), (E2E_PROMPT_LEN - 1, None),
                                                  (E2E_PROMPT_LEN - 1, 1)],
                         ids=["whole-chunks", "all-but-the-last-token", "second-chunk-lost"])
def test_a_layerwise_load_computes_the_rest_in_its_own_step(
        ctx: zmq.Context, model_path: Path, model_config: ModelConfig, num_load: int,
        lost_chunk: int | None) -> None:
    """C loads B's KV and computes the rest of its prompt in the same step, its forward
    waiting for each layer's KV (issue 24, point 2): its first token comes from that step and
    its tokens are B's. A chunk lost since the admission makes the load short: that step
    samples nothing for C, C rolls back to what was loaded, and resuming from there gives B's
    tokens all the same."""
    with computed_by_b(ctx, model_path, model_config) as (runner, store, b):
        prompt, expected = b.prompt, b.expected
        if lost_chunk is not None:
            lost = keys(prompt, b.kv_slice, E2E_BLOCK, E2E_CHUNK)[lost_chunk]
            assert store.tiers[0].remove(lost)      # evicted since the admission

        c_blocks = list(range(80, 80 + -(-(E2E_PROMPT_LEN + MAX_TOKENS) // E2E_BLOCK)))
        prompt_blocks = -(-E2E_PROMPT_LEN // E2E_BLOCK)
        launched = runner.launch(StepInput(100, [NewRequest(
            "c", prompt, len(prompt), GREEDY, [c_blocks[:prompt_blocks]], 0,
            E2E_PROMPT_LEN - num_load, num_load_tokens=num_load)], [], []))
        out = runner.finish(launched)
        assert launched.loads is not None and launched.loads.inline_ids == ["c"]
        state = runner.input_batch.requests["c"]
        if lost_chunk is None:
            assert launched.loads.wait() == {"c": num_load}
            assert isinstance(out, StepOutput) and out.request_ids == ["c"]
            tokens = list(out.sampled_token_ids)
            num_computed = E2E_PROMPT_LEN
        else:
            num_loaded = lost_chunk * E2E_CHUNK
            assert launched.loads.wait() == {"c": num_loaded}
            assert isinstance(out, StepOutput) and out.request_ids == []
            assert state.num_computed_tokens == num_loaded      # rolled back
            tokens, num_computed = [], num_loaded
        assert run_c(runner, c_blocks, num_computed, prompt_blocks, tokens) == expected


def run_c(runner: ModelRunner, c_blocks: list[int], num_computed: int, num_blocks: int,
          tokens: list[int]) -> list[int]:
    """C's steps from `num_computed` tokens in its first `num_blocks` blocks: the rest of its
    prompt, then decodes, until it has MAX_TOKENS tokens (`tokens`: those it has)."""
    tokens = list(tokens)
    num_new = E2E_PROMPT_LEN - num_computed if num_computed < E2E_PROMPT_LEN else 1
    step_id = 101
    while len(tokens) < MAX_TOKENS:
        end_blocks = -(-(num_computed + num_new) // E2E_BLOCK)
        out = runner.execute(StepInput(step_id, [], [RunningRequest(
            "c", num_computed, num_new, [c_blocks[num_blocks:end_blocks]], [])], []))
        assert isinstance(out, StepOutput) and out.request_ids == ["c"]
        tokens += out.sampled_token_ids
        num_blocks = max(num_blocks, end_blocks)
        num_computed, num_new = num_computed + num_new, 1
        step_id += 1
    return tokens
