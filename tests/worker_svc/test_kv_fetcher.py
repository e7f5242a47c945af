"""ChunkFetcher: a load's chunks stream in one by one from a real KV store on a TCP socket,
so the loader copies the first while the next are on their way (issue 24, point 2); a loader
that stops early or a miss ends the fetch cleanly."""

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvcache_svc.kv_store.disk_tier import DiskTier
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.kv_store_client import KvStoreClient
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, chunk, key
from tests.kvcache_svc.kv_store.serving import client_codec, serving
from worker_svc.kv_fetcher import ChunkFetcher

DISK_DELAY_S = 0.3      # per chunk read: a slow tier makes the streaming visible


@pytest.fixture
def fetcher(ctx: zmq.Context, tmp_path: Path) -> Iterator[ChunkFetcher]:
    store = KvStore([MemoryTier(0), DiskTier(tmp_path, 1 << 20, delay_s=DISK_DELAY_S)],
                    chunk_tokens=CHUNK_TOKENS)
    store.save([(chunk(i).header, chunk(i).data) for i in range(3)])
    with serving(ctx, store) as loop:
        fetching = ChunkFetcher(lambda c: KvStoreClient(c, loop.address, codec=client_codec()))
        yield fetching
        fetching.close()


def test_chunks_arrive_one_by_one_not_all_at_the_end(fetcher: ChunkFetcher) -> None:
    started = time.monotonic()
    arrivals = []
    for i, found in enumerate(fetcher.fetch([key(0), key(1), key(2)])):
        assert found is not None and bytes(found.data) == bytes(chunk(i).data)
        arrivals.append(time.monotonic() - started)
    assert len(arrivals) == 3
    # The first chunk was in hand one disk read in, while two more reads were still to come.
    assert arrivals[0] < arrivals[2] - 1.5 * DISK_DELAY_S, arrivals


def test_a_loader_that_stops_early_leaves_the_fetcher_ready(fetcher: ChunkFetcher) -> None:
    for found in fetcher.fetch([key(0), key(1), key(2)]):
        assert found is not None
        break
    assert [c is not None for c in fetcher.fetch([key(2)])] == [True]


def test_a_miss_ends_the_run(fetcher: ChunkFetcher) -> None:
    found = list(fetcher.fetch([key(0), key(7), key(1)]))
    assert [c is not None for c in found] == [True, False]
