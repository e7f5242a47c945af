"""A worker placed again (fail-over, re-registration) measures the memory it measured the first
time: its old KV cache, graphs and staging buffers are freed first, and a shard it no longer
serves is closed with its threads. Driven through the worker's own placement path
(`Placer.place`, then `Placer.init_cache`, as `WorkerServer._incarnation` calls them) with a real
ModelRunner, a real KV store client on a real socket, and the host's real MemAvailable."""

import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.rpc.splitserve.v1 import control_pb2
from services.wire import CacheReady, InitCache
from tests.kvcache_svc.kv_store.serving import client_codec, serving
from worker_svc import placement as placement_module
from worker_svc.config import WorkerConfig
from worker_svc.kernels.cpu import CpuLevel
from worker_svc.kv_saver import KvStoreOptions
from worker_svc.placement import Placer

BLOCK_SIZE = 256
MIB = 1 << 20
# Big enough that a cache still held at the second measurement moves it well past the host's
# own drift in MemAvailable; small enough to allocate in well under a second.
FIRST_CACHE_BYTES = 2048 * MIB
CACHE_BYTES = 192 * MIB


class Outputs:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None)
    path = tmp_path_factory.mktemp("tiny-replaced")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def store_address(ctx: zmq.Context) -> Iterator[str]:
    with serving(ctx, KvStore([MemoryTier(16 * MIB)], chunk_tokens=BLOCK_SIZE)) as loop:
        yield loop.address


@pytest.fixture
def placer(tiny_model: Path, store_address: str, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[Placer]:
    # The store in this process speaks the test cluster's frame key.
    monkeypatch.setattr(placement_module, "KvStoreOptions",
                        functools.partial(KvStoreOptions, codec=client_codec()))
    placer = Placer(WorkerConfig(
        scheduler_address="localhost:1", model_path=str(tiny_model), host="127.0.0.1",
        advertise_host="127.0.0.1", port=0, worker_id="w", epoch=1,
        device=torch.device("cpu"), kv_cache_bytes=1 << 50,   # no cap: MemAvailable decides
        gpu_memory_utilization=0.9, num_threads=1, quant_kernels=False,
        cpu_level=CpuLevel.NONE, register_timeout_s=1.0, kv_store=store_address))
    yield placer
    placer.drop()


def placement(dtype: str = "float32") -> control_pb2.RegisterResponse:
    return control_pb2.RegisterResponse(
        replica_id=0, pp_rank=0, pp_size=1, tp_rank=0, tp_size=1, first_layer=0, end_layer=2,
        dtype=dtype, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=256)


def place_and_allocate(placer: Placer, where: control_pb2.RegisterResponse,
                       cache_bytes: int) -> int:
    """One placement as `_incarnation` runs it: place, measure, then the replica's InitCache.
    Returns the blocks this worker said it fits."""
    placed = placer.place(where, None)
    assert placed is not None
    runner, num_blocks = placed
    wanted = cache_bytes // runner.kv_bytes_per_block(BLOCK_SIZE)
    outputs = Outputs()
    placer.init_cache(runner, InitCache(num_blocks=wanted, block_size=BLOCK_SIZE), num_blocks,
                      outputs, where)  # type: ignore[arg-type]
    assert outputs.sent == [CacheReady(worker_id="w", num_blocks=wanted)]
    return num_blocks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_a_second_placement_measures_what_the_first_did(placer: Placer) -> None:
    first = place_and_allocate(placer, placement(), FIRST_CACHE_BYTES)
    runner = placer.runner
    assert runner is not None and runner.kv_caches
    second = place_and_allocate(placer, placement(), CACHE_BYTES)
    assert placer.runner is runner, "the same shard is kept, not loaded again"
    per_block = runner.kv_bytes_per_block(BLOCK_SIZE)
    assert FIRST_CACHE_BYTES // per_block < first     # the first cache fit the budget
    # Before the fix the second measurement saw the first cache as taken: 2 GiB less. The
    # host's MemAvailable moves by itself between the two measurements (other processes, the
    # page cache; +1.2 GB was seen in CI), so the bound is one-sided with half the cache as slack.
    slack = FIRST_CACHE_BYTES // 2 // per_block
    assert second >= first - slack, (first * per_block, second * per_block)


def test_ten_placements_leave_threads_and_memory_flat(placer: Placer) -> None:
    place_and_allocate(placer, placement(), CACHE_BYTES)
    place_and_allocate(placer, placement("bfloat16"), CACHE_BYTES)   # warm both shards once
    threads, os_thread_count, rss = threading.active_count(), os_threads(), rss_bytes()
    runners = set()
    for i in range(10):
        # Every other placement is of another shard (dtype): the old runner must be closed.
        place_and_allocate(placer, placement("float32" if i % 2 == 0 else "bfloat16"),
                           CACHE_BYTES)
        runners.add(id(placer.runner))
    assert len(runners) > 1
    assert threading.active_count() == threads
    assert os_threads() == os_thread_count
    # A cache kept by mistake would add 192 MiB a placement; the noise is a few MiB.
    assert rss_bytes() - rss < 64 * MIB, (rss, rss_bytes())
