"""The store under load (issue 24): partial chunks extended by later saves, store I/O outside
the lock (a disk slowed to 500 ms per chunk delays no lookup), and loads served while large
saves are in flight on the store's socket."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvcache_svc.kv_store import server
from kvcache_svc.kv_store.disk_tier import DiskTier
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from services.kv_chunks import KvChunk, make_chunk
from services.kv_store_client import KvStoreClient
from tests.kvcache_svc.kv_store.common import CHUNK_TOKENS, SLICE, block_hash, chunk, key
from tests.kvcache_svc.kv_store.serving import client_codec, serving

SLOW_DISK_S = 0.5       # the injected delay per chunk read or written
ROW = 4 * 64 * 2        # bytes per token of one (layer, k/v) row: 4 heads x 64 dims x fp16


def kv_chunk(i: int, num_tokens: int, start: int = 0, base: int | None = None) -> KvChunk:
    """Tokens [start, num_tokens) of a [2 layers, 2, tokens, 4 heads, 64] fp16 chunk keyed
    by block_hash(i); each token's bytes are its index, so merges can be checked."""
    rows = [bytes([t % 251]) * ROW for t in range(start, num_tokens)]
    data = b"".join(b"".join(rows) for _ in range(4))
    base_key = None if base is None else key(base, start)
    return make_chunk(key(i, num_tokens), (2, 2, num_tokens - start, 4, 64), data, base_key)


def save(store: KvStore, *chunks: KvChunk) -> tuple[int, int]:
    return store.save([(c.header, c.data) for c in chunks])


def test_a_later_save_extends_a_partial_chunk_with_only_its_new_tokens() -> None:
    """The seeds' scenario in the store: 12 tokens, then the next 4 as an extension; the
    store keeps both prefixes and counts only the 4 new tokens as stored the second time."""
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    assert save(store, kv_chunk(1, 12)) == (1, 0)
    assert save(store, kv_chunk(2, 16, start=12, base=1)) == (1, 0)
    whole = store.get(key(2, 16))
    assert whole is not None and whole.header.shape == (2, 2, 16, 4, 64)
    assert bytes(whole.data) == bytes(kv_chunk(3, 16).data)   # the same as one whole save
    assert store.lookup([key(1, 12)]) == 1                    # the shorter prefix stays
    stats = store.stats()
    assert (stats.num_stored_chunks, stats.num_stored_tokens) == (2, 16)
    assert stats.num_stored_bytes == 16 * ROW * 4
    assert save(store, kv_chunk(2, 16, start=12, base=1)) == (0, 1)   # held: skipped
    assert store.stats().num_skipped_tokens == 4


def test_an_extension_whose_base_is_gone_is_not_stored() -> None:
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    assert save(store, kv_chunk(2, 16, start=12, base=1)) == (0, 0)
    assert store.lookup([key(2, 16)]) == 0
    save(store, make_chunk(key(1, 12), (2, 2, 12, 4, 32), bytes(2 * 2 * 12 * 4 * 32 * 2)))
    assert save(store, kv_chunk(2, 16, start=12, base=1)) == (0, 0)   # other heads' shape


def test_a_slow_disk_delays_no_lookup_and_no_memory_load(tmp_path: Path) -> None:
    """Four chunks spill to a disk that takes 500 ms per chunk; meanwhile lookups (what a plan
    call's admission asks) and loads from memory answer at once."""
    size = len(chunk(0).data)
    store = KvStore([MemoryTier(2 * size), DiskTier(tmp_path, 1 << 20, delay_s=SLOW_DISK_S)],
                    chunk_tokens=CHUNK_TOKENS)
    save(store, chunk(100), chunk(101))
    view = StoreView(store, [SLICE], block_size=CHUNK_TOKENS)
    writer = threading.Thread(target=save, args=(store, *[chunk(i) for i in range(4)]))
    started = time.monotonic()
    writer.start()
    slowest = 0.0
    while writer.is_alive():
        begin = time.monotonic()
        store.lookup_many([[key(i) for i in range(6)]], record=False)
        view.num_held_blocks([block_hash(i) for i in range(4)])
        store.get(key(3))
        slowest = max(slowest, time.monotonic() - begin)
        time.sleep(0.01)
    writer.join()
    assert time.monotonic() - started >= 3 * SLOW_DISK_S        # the disk was slow indeed
    assert slowest < 0.2, slowest
    assert store.lookup([key(i) for i in range(4)]) == 4         # spilled ones found too
    store.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def test_loads_are_served_while_big_saves_are_in_flight(ctx: zmq.Context,
                                                       tmp_path: Path) -> None:
    """Two savers send 128 MiB each to a store whose disk takes 500 ms per chunk (scaled down
    from the issue's 1 GiB for a shared test machine); a load sent meanwhile comes back
    within its usual time."""
    memory = 1 << 20
    store = KvStore([MemoryTier(memory), DiskTier(tmp_path, 1 << 30, delay_s=SLOW_DISK_S)],
                    chunk_tokens=CHUNK_TOKENS)
    wanted = chunk(7)
    save(store, wanted)
    big = [make_chunk(key(1000 + i), (1, 16 << 20), bytes(32 << 20)) for i in range(8)]
    with serving(ctx, store) as loop:
        results: list[object] = []

        def send(part: list[KvChunk]) -> None:
            client = KvStoreClient(ctx, loop.address, timeout_ms=60_000, codec=client_codec())
            try:
                results.append(client.save(part))
            finally:
                client.close()

        savers = [threading.Thread(target=send, args=(big[i::2],)) for i in range(2)]
        for saver in savers:
            saver.start()
        time.sleep(0.5)                          # the saves are being received and written
        reader = KvStoreClient(ctx, loop.address, timeout_ms=2000, codec=client_codec())
        try:
            begin = time.monotonic()
            [loaded] = reader.load([wanted.key])
            elapsed = time.monotonic() - begin
            busy = any(saver.is_alive() for saver in savers)
        finally:
            reader.close()
        for saver in savers:
            saver.join(120)
    assert loaded is not None and bytes(loaded.data) == bytes(wanted.data)
    assert busy, "the saves were over before the load: the test proves nothing"
    assert elapsed < 1.0, elapsed
    assert len(results) == 2


def test_saves_past_the_pending_limit_are_refused_at_once(
        ctx: zmq.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One save may wait (limit patched to 1) on a slow disk: the others are refused without
    waiting for it, and the store holds what it accepted."""
    monkeypatch.setattr(server, "MAX_PENDING_SAVES", 1)
    store = KvStore([MemoryTier(0), DiskTier(tmp_path, 1 << 20, delay_s=SLOW_DISK_S)],
                    chunk_tokens=CHUNK_TOKENS)
    with serving(ctx, store) as loop:
        results: dict[int, object] = {}

        def send(i: int) -> None:
            client = KvStoreClient(ctx, loop.address, timeout_ms=10_000, codec=client_codec())
            try:
                begin = time.monotonic()
                results[i] = (client.save([chunk(i)]), time.monotonic() - begin)
            finally:
                client.close()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    outcomes = [results[i] for i in range(3)]
    stored = [r for r, _ in outcomes if r.num_stored_chunks == 1]   # type: ignore[attr-defined]
    refused = [t for r, t in outcomes if r.num_failed_chunks == 1]  # type: ignore[attr-defined]
    assert len(stored) >= 1 and len(refused) >= 1, outcomes
    assert max(refused) < SLOW_DISK_S, outcomes       # not kept waiting behind the slow save
