"""Saving computed KV to kvcache_svc's KV store, across real processes with default flags: the
launcher gives every worker the store's address, and after a long prompt the store holds its
whole chunks under the keys the scheduler will look up (cache salt included)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from services import cluster_token
from services.block_hash import hash_full_blocks
from services.codec import Codec
from services.kv_chunks import KvSlice, chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, FromKvStore
from services.model_config import default_model_path, load_model_config
from tests.e2e.harness import RunningCluster, greedy_request, run_cluster, stream_tokens, wait_for

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
