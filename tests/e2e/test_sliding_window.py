"""A hybrid model (Qwen3 with sliding and full layers, window 16) through the real services,
greedy token for token against HF transformers in fp32, with prompts of 30-45 tokens (past
the window): under a tiny token budget (every prompt chunked, chunks crossing the window's
edge), a tiny KV pool (preemption by recompute), a prefix hit, the KV store saving chunks of
8 tokens (the sliding group keeps a chunk's blocks until it is saved, and frees them after),
and two pipeline stages, each holding a full and a sliding layer (one KV tensor each: the
split cuts both groups). A long request's sliding group holds a window of blocks."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler_svc.engine.kv_blocks import LOOKAHEAD_BLOCKS
from scripts.random_family import build_family_model
from services.kv_groups import max_blocks_in_window
from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.harness import (
    RunningCluster,
    greedy_request,
    hf_greedy_tokens,
    run_cluster,
    stream_tokens,
)

pytestmark = pytest.mark.e2e

WINDOW = 16
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
NUM_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(model directory, prompts, HF's greedy tokens for each)."""
    path = tmp_path_factory.mktemp("models") / "hybrid"
    model = build_family_model(path, "qwen3", num_layers=4, vocab_size=49152, tokenizer=True,
                               use_sliding_window=True, sliding_window=WINDOW,
                               layer_types=LAYER_TYPES)
    generator = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist()
               for n in (45, 30, 38, 33)]
    references = [hf_greedy_tokens(model, p, NUM_NEW_TOKENS) for p in prompts]
    assert len({t for r in references for t in r}) >= 8, references
    return path, prompts, references


def generate_all(cluster: RunningCluster, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_tokens, cluster.stub, greedy_request(p, NUM_NEW_TOKENS))
                   for p in prompts]
        return [f.result()[0] for f in futures]


def test_chunks_preemption_and_prefix_hits(tmp_path: Path, hybrid) -> None:  # type: ignore[no-untyped-def]
    path, prompts, references = hybrid
    # 7 tokens a step in blocks of 4: every prompt is prefilled over 5-7 steps, and the
    # windowed layers' keys start inside a chunk. The model is two KV groups (full, sliding)
    # of two layers: 40 blocks hold any one request (15 blocks in the full group, at most 7
    # in the sliding one) but not all four at once (about 80): requests are preempted and
    # recomputed.
    args = ["--max-num-batched-tokens", "7", "--block-size", "4", "--num-kv-blocks", "40"]
    with run_cluster(tmp_path, scheduler_args=args, model=str(path),
                     kvcache_args=["--kv-chunk-tokens", "8"]) as cluster:
        assert generate_all(cluster, prompts) == references
        info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest()).replicas[0]
        assert info.num_preemptions > 0, "the small pool should have forced preemption"
        # The same prompt again, twice: the other requests' churn may have evicted its
        # blocks, but after the first its full blocks are cached; the second then reuses the
        # full group's blocks from the start and the sliding group's last window only.
        for _ in range(2):
            ids, _, last = stream_tokens(cluster.stub,
                                         greedy_request(prompts[0], NUM_NEW_TOKENS))
            assert ids == references[0]
        assert last.usage.cached_prompt_tokens > WINDOW, "a prefix hit past the window"
        # Chunks were saved (and, when the churn evicted prompt 0's blocks, loaded back).
        assert cluster.kv_stats().store.num_stored_chunks > 0


def test_two_pipeline_stages_split_the_hybrid_model(tmp_path: Path, hybrid) -> None:  # type: ignore[no-untyped-def]
    path, prompts, references = hybrid
    with run_cluster(tmp_path, pp=2, model=str(path)) as cluster:
        assert generate_all(cluster, prompts) == references


def test_a_long_request_holds_a_window_of_blocks_in_its_sliding_group(
        tmp_path: Path, hybrid) -> None:  # type: ignore[no-untyped-def]
    """A 300-token prompt decoding 60 tokens (no KV store, so the window alone decides):
    mid-decode, kvcache_svc's pool holds the full group's blocks and at most
    ceil(16 / 4) + 1 = 5 in the sliding group, where treating both groups as full attention
    would hold twice the full group's. The tokens are HF's."""
    path, _, _ = hybrid
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49152, (300,), generator=generator).tolist()
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    reference = hf_greedy_tokens(model, prompt, 60)
    args = ["--block-size", "4"]
    with run_cluster(tmp_path, scheduler_args=args, model=str(path),
                     kvcache_args=["--no-kv-store"]) as cluster:
        def steps() -> int:
            info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest())
            return info.replicas[0].num_steps

        tokens: list[int] = []
        used = steps_done = None
        steps_before = steps()
        for chunk in cluster.stub.Generate(greedy_request(prompt, 60), timeout=300):
            tokens.extend(chunk.token_ids)
            if used is None and len(tokens) >= 30:
                [pool] = cluster.kv_stats().pools
                used = pool.num_used_blocks
                steps_done = steps() - steps_before
        assert tokens == reference
    assert used is not None and steps_done is not None
    # When the pool was read the engine may have been ahead of this client's stream (a loaded
    # machine): its steps bound where the request was. Each step gives it at most one token,
    # and async scheduling holds the blocks of up to two steps not yet done. A plan grows
    # each group LOOKAHEAD_BLOCKS ahead, and the sliding group gives back what its window
    # left at plans only (as many steps apart as the full group's blocks grown ahead).
    full_blocks = -(-(len(prompt) + steps_done + 2) // 4)
    bound = max_blocks_in_window(WINDOW, 4)
    assert bound == 5
    assert 83 < used <= full_blocks + bound + 3 * LOOKAHEAD_BLOCKS, (used, steps_done)
    assert used < 2 * 83 * 0.6, "no better than every layer full"
