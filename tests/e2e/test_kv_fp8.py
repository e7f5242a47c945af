"""--kv-cache-dtype fp8 across real processes (issue 39, point 1): the scheduler's flag reaches
every worker through its placement; the worker sizes its pages at one byte an element (a
quarter of float32's, so four times the blocks for the same budget), serves, hits its prefix
cache, and saves chunks to the KV store under its own dtype and scales, which a float32
lookup of the same tokens never matches."""

import re
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
from services.weights_fingerprint import weights_model_name
from tests.e2e.harness import RunningCluster, greedy_request, run_cluster, stream_tokens, wait_for

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningCluster]:
    with run_cluster(tmp_path_factory.mktemp("cluster"),
                     scheduler_args=("--kv-cache-dtype", "fp8")) as running:
        yield running


def worker_log(cluster: RunningCluster) -> str:
    return "\n".join(p.read_text() for p in cluster.log_dir.glob("worker*"))


def test_the_worker_sizes_one_byte_pages(cluster: RunningCluster) -> None:
    config = load_model_config(default_model_path())
    fp8_page = 2 * BLOCK_SIZE * config.num_kv_heads * config.head_dim * config.num_layers
    found = re.search(r"fits (\d+) blocks of 16 tokens \((\d+) bytes each", worker_log(cluster))
    assert found, worker_log(cluster)
    num_blocks, page = int(found[1]), int(found[2])
    assert page == fp8_page                        # float32's would be 4x
    assert num_blocks * page <= int(0.25 * (1 << 30)) < (num_blocks + 1) * page


def test_serves_and_hits_its_prefix_cache(cluster: RunningCluster) -> None:
    prompt = [(11 * i + 5) % 4000 + 20 for i in range(70)]
    first, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 8))
    again, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 8))
    assert len(first) == 8
    assert again == first                          # the second read its cached fp8 blocks


def test_chunks_are_stored_under_the_8bit_dtype_only(cluster: RunningCluster,
                                                     tmp_path: Path) -> None:
    config = load_model_config(default_model_path())
    prompt = [(7 * i + 3) % 5000 + 10 for i in range(600)]
    ids, _, _ = stream_tokens(cluster.stub, greedy_request(prompt, 2))
    assert len(ids) == 2
    ctx = zmq.Context()
    codec = Codec(FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES,
                  key=cluster_token.frame_key(cluster.token))
    client = KvStoreClient(ctx, f"tcp://127.0.0.1:{cluster.procs.spec.kv_store_port}",
                           codec=codec)
    try:
        info = client.describe()
        assert info is not None
        model = weights_model_name(config.name, default_model_path())
        hashes = hash_full_blocks(prompt, BLOCK_SIZE)

        def keys(name: str, dtype: str) -> list:  # type: ignore[type-arg]
            kv_slice = KvSlice(name, dtype, 0, config.num_layers, 0, config.num_kv_heads)
            return chunk_keys(hashes, BLOCK_SIZE, info.chunk_tokens, kv_slice)

        fp8 = keys(model + "+k1v1", "float8_e4m3fn")
        assert wait_for(lambda: client.lookup(fp8) == len(fp8), 10), worker_log(cluster)
        assert client.lookup(keys(model, "float32")) == 0
        assert client.lookup(keys(model, "float8_e4m3fn")) == 0    # other scales: no match
    finally:
        client.close()
        ctx.term()
