"""Saving computed KV to kvcache_svc's KV store, across real processes with default flags: the
launcher gives every worker the store's address, and after a long prompt the store holds its
whole chunks under the keys the scheduler will look up (cache salt included)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from scheduler_svc.tokenizer import ChatMessage
from services import cluster_token
from services.block_hash import hash_full_blocks
from services.codec import Codec
from services.kv_chunks import KvSlice, chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore
from services.model_config import default_model_path, load_model_config
from services.rpc.splitserve.v1 import generation_pb2
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
        kv_slice = KvSlice(config.name, "float32", 0, config.num_layers, 0,
                           config.num_kv_heads)
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


def test_evicted_prefix_is_loaded_from_the_store(tmp_path: Path, tokenizer, oracle) -> None:  # type: ignore[no-untyped-def]
    """A prefix evicted from the replica's blocks (a tiny pool) is loaded, not recomputed, and
    the outputs equal the oracle's, as they do cold."""
    first = document_prompt(tokenizer, "What is the capital of France?")
    other = document_prompt(tokenizer, "Why is the sky blue?", 3, title="Part")[:1000]
    assert len(first) > 512
    ref, margins = oracle.greedy(first, 12)
    with run_cluster(tmp_path, scheduler_args=["--num-kv-blocks", "80"]) as cluster:
        cold, _, _ = stream_tokens(cluster.stub, greedy_request(first, 12))
        assert_matches_reference(cold, ref, margins, "cold")
        assert wait_for(lambda: cluster.kv_stats().store.num_stored_chunks >= 2, 10)
        stream_tokens(cluster.stub, greedy_request(other, 2))     # evicts the first's blocks
        warm, _, _ = stream_tokens(cluster.stub, greedy_request(first, 12))
        assert warm == cold
        [replica] = replica_info(cluster)
        assert replica.num_store_loaded_tokens >= 512, replica
        assert replica.num_store_load_fallbacks == 0
        assert cluster.kv_stats().store.num_loaded_chunks >= 2
