"""Saving computed KV to kvcache_svc's KV store, across real processes with default flags: the
launcher gives every worker the store's address, and after a long prompt the store holds its
whole chunks under the keys the scheduler will look up (cache salt included)."""

import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from scheduler_svc.frontend.tokenizer import ChatMessage
from services import cluster_token
from services.block_hash import hash_full_blocks
from services.codec import Codec
from services.kv_chunks import KvSlice, chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore
from services.model_config import default_model_path, load_model_config
from services.rpc.splitserve.v1 import generation_pb2, kvcache_pb2
from services.weights_fingerprint import weights_model_name
from tests.e2e.conftest import QUESTIONS
from tests.e2e.harness import (
    RunningCluster,
    assert_matches_reference,
    greedy_request,
    run_cluster,
    stream_tokens,
    wait_for,
)

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 16      # the scheduler's default --block-size
SALT = "tenant-kv"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


def test_long_prompt_is_stored_in_whole_chunks(cluster: RunningCluster,
                                               tmp_path: Path) -> None:
    config = load_model_config(default_model_path())
    prompt = [(7 * i + 3) % 5000 + 10 for i in range(600)]
    request = greedy_request(prompt, 4)
    request.cache_salt = SALT
    ids, _, _ = stream_tokens(cluster.stub, request)
    assert len(ids) == 4

    ctx = zmq.Context()
    codec = Codec(FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES,
                  key=cluster_token.frame_key(cluster.token))
    client = KvStoreClient(ctx, f"tcp://127.0.0.1:{cluster.procs.spec.kv_store_port}",
                           codec=codec)
    try:
        info = client.describe()
        assert info is not None
        model = weights_model_name(config.name, default_model_path())
        kv_slice = KvSlice(model, "float32", 0, config.num_layers, 0, config.num_kv_heads)
        hashes = hash_full_blocks(prompt, BLOCK_SIZE, cache_salt=SALT.encode())
        keys = chunk_keys(hashes, BLOCK_SIZE, info.chunk_tokens, kv_slice)
        assert len(keys) == 600 // info.chunk_tokens
        assert wait_for(lambda: client.lookup(keys) == len(keys), 10), cluster.logs()
        unsalted = chunk_keys(hash_full_blocks(prompt, BLOCK_SIZE), BLOCK_SIZE,
                              info.chunk_tokens, kv_slice)
        assert client.lookup(unsalted) == 0
    finally:
        client.close()
        ctx.term()
    worker_log = "\n".join(p.read_text() for p in cluster.log_dir.glob("worker*"))
    assert "(skip_leading_tokens=0)" in worker_log


# ------------------------------------------------------------------------------ loading

def document_prompt(tokenizer, question: str, num_repeats: int = 2,  # type: ignore[no-untyped-def]
                    title: str = "Section") -> list[int]:
    """A long shared context (a document) and a short question after it; documents of another
    `title` share nothing past the chat template's first tokens."""
    document = " ".join(f"{title} {i}: {q} The answer is written in the notes of chapter {i}."
                        for i in range(num_repeats) for q in QUESTIONS)
    return tokenizer.encode(tokenizer.render_chat(
        [ChatMessage("system", document), ChatMessage("user", question)], True))


def replica_info(cluster: RunningCluster) -> list[generation_pb2.ReplicaInfo]:
    info = cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=5)
    return list(info.replicas)


def loaded_tokens(cluster: RunningCluster) -> list[int]:
    return [r.num_store_loaded_tokens for r in replica_info(cluster)]


def clear_device_caches(cluster: RunningCluster) -> None:
    """Evicts every replica's unreferenced cached blocks (kvcache_svc's admin Clear)."""
    cluster.kv_admin.Clear(kvcache_pb2.ClearRequest(), timeout=5, metadata=cluster.metadata)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-prefill", "no-chunked-prefill"])
def test_evicted_prefix_is_loaded_from_the_store(tmp_path: Path, tokenizer, oracle,  # type: ignore[no-untyped-def]
                                                 chunked: bool) -> None:
    """A prefix evicted from the replica's blocks (a tiny pool) is loaded, not recomputed, and
    the outputs equal the oracle's, as they do cold; with chunked prefill on and off."""
    first = document_prompt(tokenizer, "What is the capital of France?")
    other = document_prompt(tokenizer, "Why is the sky blue?", 3, title="Part")[:1000]
    assert len(first) > 512
    ref, margins = oracle.greedy(first, 12)
    args = ["--num-kv-blocks", "80"] + ([] if chunked else ["--no-chunked-prefill"])
    with run_cluster(tmp_path, scheduler_args=args) as cluster:
        cold, _, _ = stream_tokens(cluster.stub, greedy_request(first, 12))
        assert_matches_reference(cold, ref, margins, "cold")
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= 2, 10)
        stream_tokens(cluster.stub, greedy_request(other, 2))     # evicts the first's blocks
        warm, _, _ = stream_tokens(cluster.stub, greedy_request(first, 12))
        assert warm == cold
        [replica] = replica_info(cluster)
        assert replica.num_store_loaded_tokens >= 512, replica
        assert replica.num_store_hit_tokens == replica.num_store_loaded_tokens
        assert replica.num_store_load_fallbacks == 0
        # The hit's step computed the rest of the prompt as each layer's KV landed.
        assert " layer by layer " in worker_logs(cluster)
        assert cluster.kv_stats().store.num_loaded_chunks >= 2
        if chunked:   # once: the store's counters in ServerInfo and /metrics
            def probed() -> generation_pb2.ServerInfoResponse:
                return cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=5)

            # The scheduler's probe of kvcache_svc brings the store's counters (~1 s old).
            assert wait_for(lambda: probed().kv_store.num_loaded_chunks >= 2, 10)
            info = probed()
            assert info.kv_store.num_stored_chunks >= 3 and info.kv_store.chunk_tokens == 256
            assert info.kv_store.tiers[0].name == "memory"
            assert info.kv_store.tiers[0].num_chunks >= 3
            assert info.kv_store_saves_skipped == 0
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{cluster.procs.spec.metrics_port}/metrics",
                    timeout=10) as r:
                text = r.read().decode()
            loaded = next(line for line in text.splitlines()
                          if line.startswith("splitserve:kv_store_loaded_tokens_total"))
            assert float(loaded.split()[-1]) >= 512
            assert 'splitserve:kv_store_tier_chunks{model_name=' in text


def worker_logs(cluster: RunningCluster) -> str:
    return "\n".join(p.read_text() for p in cluster.log_dir.glob("worker*"))


def test_second_replica_loads_what_the_first_computed(tmp_path: Path, tokenizer, oracle,  # type: ignore[no-untyped-def]
                                                       ) -> None:
    """Replica 1 serves a prompt whose prefix replica 0 computed, loading it from the store.
    (Routing weighs load heavily here, so a busy replica 0 sends the prompt to replica 1.)"""
    prompt = document_prompt(tokenizer, "Who wrote Romeo and Juliet?")
    busy = document_prompt(tokenizer, "Name a famous painting.", 1, title="Part")
    ref, margins = oracle.greedy(prompt, 12)
    with run_cluster(tmp_path, num_replicas=2, worker_args=["--threads", "1"],
                     scheduler_args=["--route-tokens-per-request", "100000"]) as cluster:
        assert wait_for(lambda: len(replica_info(cluster)) == 2
                        and all(r.state == "ready" for r in replica_info(cluster)), 60)
        cold, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        assert_matches_reference(cold, ref, margins, "cold")
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= 2, 10)
        long_run = cluster.stub.Generate(greedy_request(busy, 200), timeout=120)
        next(iter(long_run))                                  # replica 0 is busy now
        warm, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        long_run.cancel()
        assert warm == cold
        assert loaded_tokens(cluster)[1] >= 512, replica_info(cluster)


def test_restarted_worker_warms_up_from_the_store(tmp_path: Path, tokenizer, oracle) -> None:  # type: ignore[no-untyped-def]
    """A worker SIGKILLed and replaced (an empty cache) loads the prefix its predecessor
    computed instead of recomputing it."""
    prompt = document_prompt(tokenizer, "What does a CPU do?")
    ref, margins = oracle.greedy(prompt, 12)
    with run_cluster(tmp_path) as cluster:
        cold, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        assert_matches_reference(cold, ref, margins, "cold")
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= 2, 10)
        cluster.procs.signal("worker0", signal.SIGKILL)
        cluster.procs.procs.pop("worker0").wait()
        assert wait_for(lambda: all(r.state == "down" for r in replica_info(cluster)), 30)
        cluster.procs.add_worker("worker1")
        assert wait_for(lambda: any(r.state == "ready" for r in replica_info(cluster)), 120)
        warm, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        assert warm == cold
        [new] = [r for r in replica_info(cluster) if r.state == "ready"]
        assert new.num_store_loaded_tokens >= 512, new


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_ranks_load_their_own_slices(tmp_path: Path, tokenizer, oracle,  # type: ignore[no-untyped-def]
                                              tp: int, pp: int) -> None:
    """With tp=2 (KV heads split) or pp=2 (layers split) each rank saves and loads its own
    slice; after the device prefix is evicted the outputs are the same."""
    prompt = document_prompt(tokenizer, "Why is the sky blue?")
    ref, margins = oracle.greedy(prompt, 12)
    with run_cluster(tmp_path, tp=tp, pp=pp, worker_args=["--threads", "1"]) as cluster:
        cold, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        assert_matches_reference(cold, ref, margins, "cold")
        num_chunks = 2 * (len(prompt) // 256)      # every rank stores its slice of each chunk
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= num_chunks, 10)
        clear_device_caches(cluster)
        warm, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        assert warm == cold
        [replica] = replica_info(cluster)
        assert replica.num_store_loaded_tokens >= 512 and replica.num_store_load_fallbacks == 0
        # TP ranks load layer by layer (and agree on the counts); pipeline stages load first.
        layerwise = [" layer by layer " in p.read_text()
                     for p in sorted(cluster.log_dir.glob("worker*"))]
        assert layerwise == [pp == 1] * 2, layerwise


def test_damaged_chunks_are_recomputed_not_loaded(tmp_path: Path, tokenizer, oracle) -> None:  # type: ignore[no-untyped-def]
    """Chunks on the disk tier (the memory tier is too small to hold one) that are corrupted
    or truncated after they were stored are dropped by the store; the load comes back short
    and the rest is recomputed: same outputs, a fallback counted, no error to the client."""
    prompt = document_prompt(tokenizer, "List three prime numbers.")
    store_dir = tmp_path / "store"
    ref, margins = oracle.greedy(prompt, 12)
    env = {"SPLITSERVE_KV_STORE_DIR": str(store_dir), "SPLITSERVE_KV_STORE_MEMORY_GIB": "0.001"}
    with run_cluster(tmp_path / "logs", env=env) as cluster:
        cold, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
        assert_matches_reference(cold, ref, margins, "cold")
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= 3, 10)
        files = sorted(p for p in store_dir.rglob("*") if p.is_file() and p.stat().st_size
                       > 1 << 20)
        assert len(files) >= 3, files
        for i, damage in enumerate(("flip", "truncate")):
            for path in files:
                data = bytearray(path.read_bytes())
                if damage == "flip":
                    data[len(data) // 2] ^= 0xFF
                    path.write_bytes(bytes(data))
                else:
                    path.write_bytes(bytes(data[:len(data) // 2]))
            clear_device_caches(cluster)
            warm, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 12))
            assert warm == cold, damage
            [replica] = replica_info(cluster)
            assert replica.num_store_load_fallbacks == i + 1, replica
            store = cluster.kv_stats().store
            assert store.num_loaded_chunks == 0
            disk = next(t for t in store.tiers if t.name == "disk")
            assert disk.num_dropped_chunks >= 1
            # The recompute saved again what the load found damaged (the first chunk: a load
            # fetches chunk by chunk and stops there; the later damaged files are found by the
            # load that reads them): damage the new files next round.
            assert wait_for(lambda n=4 + i: cluster.kv_stats().store.num_stored_chunks >= n,
                            10)
            files = sorted(p for p in store_dir.rglob("*") if p.is_file()
                           and p.stat().st_size > 1 << 20)
