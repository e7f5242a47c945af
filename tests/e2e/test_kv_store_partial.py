"""Partial chunks and weight fingerprints in the KV store, across real processes (issue 24):
the seeds' scenario (a 32-token prompt prefilled in chunks of 24 and 8 stores 24 tokens, then
logs `stored KV for 8 of 32 tokens (skip_leading_tokens=24)`; once its blocks are evicted the
same prompt loads 31 tokens and computes one, with the oracle's and the cold run's tokens and
the store hits in its usage), and a model swapped under the same path never served the old
weights' KV from a disk tier that outlived a restart."""

from pathlib import Path

import pytest
import zmq

from scripts.random_model import build_model
from services import cluster_token
from services.block_hash import hash_full_blocks
from services.codec import Codec
from services.kv_chunks import KvSlice, prefix_chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore
from services.model_config import load_model_config
from services.weights_fingerprint import weights_model_name
from tests.e2e.harness import (
    RunningCluster,
    assert_matches_reference,
    greedy_request,
    run_cluster,
    stream_tokens,
    wait_for,
)
from tests.e2e.test_kv_store import clear_device_caches, document_prompt, replica_info

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 16         # the scheduler's default --block-size


def test_the_seeds_32_tokens_store_24_then_8_and_a_hit_computes_one(
        tmp_path: Path, tokenizer, oracle) -> None:  # type: ignore[no-untyped-def]
    prompt = document_prompt(tokenizer, "What is the capital of France?")[:32]
    ref, margins = oracle.greedy(prompt, 8)
    with run_cluster(tmp_path, scheduler_args=["--max-num-batched-tokens", "24"]) as cluster:
        cold, _, last = stream_tokens(cluster.stub, greedy_request(prompt, 8))
        assert_matches_reference(cold, ref, margins, "cold")
        assert (last.usage.cached_prompt_tokens, last.usage.store_hit_tokens) == (0, 0)
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_tokens >= 32, 10)
        worker_log = "\n".join(p.read_text() for p in cluster.log_dir.glob("worker*"))
        assert "stored KV for 24 of 24 tokens (skip_leading_tokens=0)" in worker_log
        assert "stored KV for 8 of 32 tokens (skip_leading_tokens=24)" in worker_log
        assert cluster.kv_stats().store.num_stored_tokens == 32    # sent, not re-counted

        clear_device_caches(cluster)
        warm, _, last = stream_tokens(cluster.stub, greedy_request(prompt, 8))
        assert warm == cold
        assert (last.usage.cached_prompt_tokens, last.usage.store_hit_tokens) == (31, 31)
        [replica] = replica_info(cluster)
        assert replica.num_store_loaded_tokens == 31, replica
        assert replica.num_store_load_fallbacks == 0
        # One step loaded the 31 tokens layer by layer and computed the last (issue 24).
        worker_log = "\n".join(p.read_text() for p in cluster.log_dir.glob("worker*"))
        assert "loaded KV of 31 of 31 tokens layer by layer (6 groups of layers)" in worker_log


def _held(cluster: RunningCluster, model: str, prompt: list[int]) -> int:
    """Chunks of `prompt` the store holds under `model`'s name (the whole model, float32)."""
    config = load_model_config(Path(cluster.procs.spec.model or ""))
    ctx = zmq.Context()
    codec = Codec(FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES,
                  key=cluster_token.frame_key(cluster.token))
    client = KvStoreClient(ctx, f"tcp://127.0.0.1:{cluster.procs.spec.kv_store_port}",
                           codec=codec)
    try:
        kv_slice = KvSlice(model, "float32", 0, config.num_layers, 0, config.num_kv_heads)
        keys = prefix_chunk_keys(hash_full_blocks(prompt, BLOCK_SIZE), prompt, 0, len(prompt),
                                 BLOCK_SIZE, 256, kv_slice)
        return client.lookup(keys)
    finally:
        client.close()
        ctx.term()


def test_weights_swapped_under_the_same_path_get_no_hit_after_a_restart(tmp_path: Path
                                                                        ) -> None:
    """A random 2-layer model stores a prompt's KV in a disk tier; restarted over the same
    directory with other weights in the same place, the prompt is computed, not loaded
    (while the old weights' chunks are still there, under the old fingerprint)."""
    model = tmp_path / "model"
    build_model(model, "smollm2", seed=0, num_layers=2, dtype="float32")
    prompt = [(13 * i + 5) % 4000 + 20 for i in range(300)]
    env = {"SPLITSERVE_KV_STORE_DIR": str(tmp_path / "store")}
    old_name = weights_model_name(load_model_config(model).name, model)
    with run_cluster(tmp_path / "logs1", model=str(model), env=env) as cluster:
        stream_tokens(cluster.stub, greedy_request(prompt, 2))
        assert wait_for(lambda: _held(cluster, old_name, prompt) == 2, 10)

    build_model(model, "smollm2", seed=1, num_layers=2, dtype="float32", force=True)
    new_name = weights_model_name(load_model_config(model).name, model)
    assert new_name != old_name
    with run_cluster(tmp_path / "logs2", model=str(model), env=env) as cluster:
        assert _held(cluster, old_name, prompt) == 2        # the old KV outlived the restart
        _, _, last = stream_tokens(cluster.stub, greedy_request(prompt, 2))
        assert last.usage.store_hit_tokens == 0
        [replica] = replica_info(cluster)
        assert replica.num_store_loaded_tokens == 0 and replica.num_store_hit_tokens == 0
        assert wait_for(lambda: _held(cluster, new_name, prompt) == 2, 10)   # stored anew
