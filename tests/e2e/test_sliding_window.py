"""A hybrid model (Qwen3 with sliding and full layers, window 16) through the real services,
greedy token for token against HF transformers in fp32, with prompts of 30-45 tokens (past
the window): under a tiny token budget (every prompt chunked, chunks crossing the window's
edge), a tiny KV pool (preemption by recompute), a prefix hit, and two pipeline stages, each
holding a full and a sliding layer."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from scripts.random_family import build_family_model
from services.rpc.splitserve.v1 import generation_pb2
from tests.e2e.harness import RunningCluster, greedy_request, run_cluster, stream_tokens

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
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            references.append(out[0, len(prompt):].tolist())
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
    # windowed layers' keys start inside a chunk. 40 blocks hold any one request (15 blocks)
    # but not all four at once (about 56): requests are preempted and recomputed.
    args = ["--max-num-batched-tokens", "7", "--block-size", "4", "--num-kv-blocks", "40"]
    with run_cluster(tmp_path, scheduler_args=args, model=str(path)) as cluster:
        assert generate_all(cluster, prompts) == references
        info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest()).replicas[0]
        assert info.num_preemptions > 0, "the small pool should have forced preemption"
        # The same prompt again: its full blocks are cached, the rest is computed.
        ids, _, last = stream_tokens(cluster.stub, greedy_request(prompts[0], NUM_NEW_TOKENS))
        assert last.usage.cached_prompt_tokens > WINDOW, "a prefix hit past the window"
        assert ids == references[0]


def test_two_pipeline_stages_split_the_hybrid_model(tmp_path: Path, hybrid) -> None:  # type: ignore[no-untyped-def]
    path, prompts, references = hybrid
    with run_cluster(tmp_path, pp=2, model=str(path)) as cluster:
        assert generate_all(cluster, prompts) == references
