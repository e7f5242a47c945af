"""The services with their worker on the GPU give HF transformers' greedy outputs (fp32, TF32
off, same GPU, same random weights), token for token up to a reference near-tie: 16 prompts at
once with chunked prefill on (CUDA graphs and eager), many small chunks, chunked prefill off,
a prefix-cache hit, a KV store hit loaded layer by layer, and preemption forced by a tiny KV
pool.

The workers are other processes: they must keep TF32 off in fp32 themselves (torch's default),
which a mismatch well above TIE_MARGIN here would show."""

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rpc.splitserve.v1 import generation_pb2, kvcache_pb2
from tests.e2e.harness import (
    RunningCluster,
    assert_matches_reference,
    greedy_request,
    stream_tokens,
    wait_for,
)
from tests.gpu.cluster import gpu_cluster, replica_info, run_concurrently
from tests.gpu.conftest import MAX_TOKENS

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16            # the scheduler's default
SMALL_TOKEN_BUDGET = 24    # not a multiple of BLOCK_SIZE: chunks start inside blocks

References = list[tuple[list[int], list[float]]]


def check_all(cluster: RunningCluster, prompts: list[list[int]], references: References,
              ) -> None:
    outputs = run_concurrently(cluster, prompts, MAX_TOKENS)
    notes = [assert_matches_reference(o, *r, label=f"prompt {i}")
             for i, (o, r) in enumerate(zip(outputs, references))]
    print("\n".join(n for n in notes if n))


@pytest.fixture(scope="class")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_path: Path,
            ) -> Iterator[RunningCluster]:
    """Default flags: chunked prefill and prefix caching on, CUDA graphs for decode steps.
    Class-scoped: it stops before the next test starts a cluster of its own (one worker per
    GPU at a time: a second would count the first's memory as taken and fit no KV)."""
    with gpu_cluster(tmp_path_factory.mktemp("gpu-cluster"), model_path) as running:
        yield running


class TestDefaultFlags:
    def test_16_concurrent_prompts_match_hf(self, cluster: RunningCluster,
                                            prompts: list[list[int]],
                                            references: References) -> None:
        check_all(cluster, prompts, references)

    def test_prefix_cache_hit_matches_hf(self, cluster: RunningCluster,
                                         prompts: list[list[int]],
                                         references: References) -> None:
        first = stream_tokens(cluster.stub, greedy_request(prompts[3], MAX_TOKENS))
        second = stream_tokens(cluster.stub, greedy_request(prompts[3], MAX_TOKENS))
        assert second[2].usage.cached_prompt_tokens >= BLOCK_SIZE, \
            "the repeat should hit the cache"
        assert second[0] == first[0]
        assert_matches_reference(second[0], *references[3], label="cached prompt 3")


    def test_kv_store_hit_loaded_layer_by_layer_matches_hf(
            self, cluster: RunningCluster, prompts: list[list[int]],
            references: References) -> None:
        """After the replica's blocks are cleared, a prompt seen before loads from the KV
        store, layer by layer: its step computes the last token as each layer group's KV
        lands (the loader's stream and CUDA events on a GPU; that step runs eagerly)."""
        prompt = prompts[5]
        first = stream_tokens(cluster.stub, greedy_request(prompt, MAX_TOKENS))
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_tokens >= len(prompt), 20)
        cluster.kv_admin.Clear(kvcache_pb2.ClearRequest(), timeout=10,
                               metadata=cluster.metadata)
        again = stream_tokens(cluster.stub, greedy_request(prompt, MAX_TOKENS))
        assert again[2].usage.store_hit_tokens == len(prompt) - 1, again[2].usage
        assert again[0] == first[0]
        assert_matches_reference(again[0], *references[5], label="store hit, prompt 5")
        logs = "\n".join(p.read_text() for p in cluster.log_dir.glob("worker*"))
        assert " layer by layer " in logs


def test_enforce_eager_matches_hf(tmp_path: Path, model_path: Path, prompts: list[list[int]],
                                  references: References) -> None:
    with gpu_cluster(tmp_path, model_path, worker_args=["--enforce-eager"]) as cluster:
        check_all(cluster, prompts, references)


def test_many_small_chunks_match_hf(tmp_path: Path, model_path: Path, prompts: list[list[int]],
                                    references: References) -> None:
    # 24 tokens per step: every prompt is spread over steps that mix its chunks with other
    # requests' chunks and decodes, and chunk starts fall inside blocks.
    args = ["--max-num-batched-tokens", str(SMALL_TOKEN_BUDGET)]
    with gpu_cluster(tmp_path, model_path, scheduler_args=args) as cluster:
        check_all(cluster, prompts, references)
        num_prompt_tokens = sum(len(p) for p in prompts)
        assert replica_info(cluster).num_steps >= num_prompt_tokens // SMALL_TOKEN_BUDGET


def test_chunked_prefill_off_matches_hf(tmp_path: Path, model_path: Path,
                                        prompts: list[list[int]],
                                        references: References) -> None:
    args = ["--no-chunked-prefill", "--max-num-batched-tokens", "64"]
    with gpu_cluster(tmp_path, model_path, scheduler_args=args) as cluster:
        info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
        assert not info.chunked_prefill
        check_all(cluster, prompts, references)


def test_forced_preemption_matches_hf(tmp_path: Path, model_path: Path,
                                      prompts: list[list[int]], references: References) -> None:
    # A pool where the largest request fits alone (plus two spare blocks) but the 16 together
    # are several times too many: running requests are preempted and recomputed.
    blocks_needed = [math.ceil((len(p) + MAX_TOKENS) / BLOCK_SIZE) for p in prompts]
    num_blocks = 1 + max(blocks_needed) + 2          # block 0 is the null block
    assert sum(blocks_needed) > 2 * (num_blocks - 1)
    args = ["--num-kv-blocks", str(num_blocks)]
    with gpu_cluster(tmp_path, model_path, scheduler_args=args) as cluster:
        check_all(cluster, prompts, references)
        replica = replica_info(cluster)
        assert replica.num_kv_blocks == num_blocks
        assert replica.num_preemptions > 0, "the tiny pool should have forced preemption"
