"""KvLoader: KV chunks fetched from a real KV store served on a TCP socket into a request's
blocks. Chunks are saved by a real KvSaver from plain KV cache tensors (random data, bit-exact
comparisons); a request that loads is validated by the InputBatch; and, end to end with the
real ModelRunner (SmolLM2, CPU), a request loaded from the store decodes the same greedy tokens
as the request that computed that KV."""

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import zmq

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services.block_hash import hash_full_blocks
from services.kv_chunks import chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey, KvSlice
from services.wire import NewRequest, RunningRequest, StepInput
from tests.kvcache_svc.kv_store.serving import client_codec, serving
from tests.worker_svc.common import GREEDY
from worker_svc import kv_loader
from worker_svc.input_batch import InputBatch
from worker_svc.kv_loader import KvLoader
from worker_svc.kv_saver import KvSaver

BLOCK_SIZE = 16
CHUNK_TOKENS = 256
PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE
NUM_BLOCKS = 128
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 3, 2, 8
SLICE = KvSlice("tiny", "float32", 0, NUM_LAYERS, 0, NUM_HEADS)
PROMPT = [(7 * i + 3) % 997 for i in range(600)]        # 2 whole chunks, 37 full blocks
A_BLOCKS = list(range(1, 39))                            # the request that computed the KV
C_BLOCKS = list(range(60, 98))                           # the request that loads it


def caches(num_heads: int = NUM_HEADS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_heads, HEAD_DIM, generator=generator)
            for _ in range(NUM_LAYERS)]


def keys(token_ids: list[int], kv_slice: KvSlice = SLICE, block_size: int = BLOCK_SIZE,
         chunk_tokens: int = CHUNK_TOKENS) -> list[ChunkKey]:
    return chunk_keys(hash_full_blocks(token_ids, block_size), block_size, chunk_tokens,
                      kv_slice)


def new_batch() -> InputBatch:
    return InputBatch(NUM_BLOCKS, BLOCK_SIZE, vocab_size=1000, max_model_len=4096)


def loading(request_id: str, num_computed: int, num_load: int, block_ids: list[int],
            token_ids: list[int] = PROMPT, num_new: int = 0) -> NewRequest:
    return NewRequest(request_id, list(token_ids), len(token_ids), GREEDY, [block_ids],
                      num_computed, num_new, num_load_tokens=num_load)


def drain(saver: KvSaver) -> None:
    deadline = time.monotonic() + 20
    while saver.num_queued_chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.num_queued_chunks == 0


@pytest.fixture
def store() -> KvStore:
    return KvStore([MemoryTier(64 << 20)], chunk_tokens=CHUNK_TOKENS)


@pytest.fixture
def address(ctx: zmq.Context, store: KvStore) -> Iterator[str]:
    with serving(ctx, store) as loop:
        yield loop.address


@pytest.fixture
def saver(address: str) -> Iterator[KvSaver]:
    kv_saver = KvSaver(address, SLICE, codec=client_codec())
    assert kv_saver.ready.wait(10), "the store never described itself"
    yield kv_saver
    kv_saver.close()


@pytest.fixture
def loader(saver: KvSaver) -> Iterator[KvLoader]:
    kv = KvLoader(saver, codec=client_codec())
    yield kv
    kv.close()


def save_a(saver: KvSaver, kv_caches: list[torch.Tensor], store: KvStore) -> None:
    """Request "a" computes PROMPT in blocks A_BLOCKS; the saver stores its 2 whole chunks
    and its tail."""
    batch = new_batch()
    scheduled = batch.apply(StepInput(0, [NewRequest("a", PROMPT, len(PROMPT), GREEDY, [A_BLOCKS],
                                                     0, len(PROMPT))], [], []))
    saver.submit(saver.copy_out(scheduled, kv_caches, BLOCK_SIZE), BLOCK_SIZE)
    drain(saver)
    assert saver.num_chunks_stored == 3                  # and the tail [512, 600), partial
    assert store.lookup(keys(PROMPT)) == 2


def load_c(loader: KvLoader, kv_caches: list[torch.Tensor], num_computed: int,
           num_load: int) -> dict[str, int]:
    """Request "c" (PROMPT again, in blocks C_BLOCKS) admitted to load; what its ticket says."""
    batch = new_batch()
    block_ids = C_BLOCKS[:-(-(num_computed + num_load) // BLOCK_SIZE)]
    step = StepInput(1, [loading("c", num_computed, num_load, block_ids)], [], [])
    assert batch.apply(step) == []                       # held, not scheduled
    state = batch.requests["c"]
    assert (state.load_start, state.num_computed_tokens) == (num_computed,
                                                             num_computed + num_load)
    ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
    assert ticket is not None and ticket.request_ids == ["c"]
    return ticket.wait()


def assert_loaded(kv_caches: list[torch.Tensor], before: list[torch.Tensor],
                  first_block: int, end_block: int) -> None:
    """C_BLOCKS[first_block:end_block] now hold A's KV bit for bit; every other block of the
    cache is as it was."""
    written = C_BLOCKS[first_block:end_block]
    for layer, (cache, old) in enumerate(zip(kv_caches, before)):
        assert torch.equal(cache[:, written], cache[:, A_BLOCKS[first_block:end_block]]), layer
        others = [b for b in range(NUM_BLOCKS) if b not in written]
        assert torch.equal(cache[:, others], old[:, others]), layer


@pytest.mark.parametrize("num_cached", [0, 128, 256], ids=["no-hit", "hit-mid-chunk",
                                                           "hit-of-a-chunk"])
def test_a_load_writes_the_saved_kv_into_the_requests_blocks_past_its_hit(
        saver: KvSaver, loader: KvLoader, store: KvStore, num_cached: int) -> None:
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    before = [cache.clone() for cache in kv_caches]
    num_load = 512 - num_cached
    assert load_c(loader, kv_caches, num_cached, num_load) == {"c": num_load}
    # The blocks of the hit (C_BLOCKS[:num_cached // BLOCK_SIZE]) are untouched.
    assert_loaded(kv_caches, before, num_cached // BLOCK_SIZE, 512 // BLOCK_SIZE)
    assert (loader.num_tokens_loaded, loader.num_loads_short) == (num_load, 0)
    assert loader.num_chunks_loaded == 2 - num_cached // CHUNK_TOKENS
    assert store.stats().num_loaded_chunks == 2 - num_cached // CHUNK_TOKENS


def tokens_of(cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    return cache[:, block_ids].reshape(2, -1, *cache.shape[3:])[:, start:end]


def test_a_load_capped_before_the_last_token_fills_its_blocks(
        saver: KvSaver, loader: KvLoader, store: KvStore) -> None:
    """A 512-token prompt loads 511 tokens (the last is computed): both chunks come, and the
    last token's slot is left to its compute."""
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    before = [cache.clone() for cache in kv_caches]
    batch = new_batch()
    step = StepInput(1, [loading("c", 0, 511, C_BLOCKS[:32], token_ids=PROMPT[:512])], [], [])
    assert batch.apply(step) == []
    ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
    assert ticket is not None and ticket.wait() == {"c": 511}
    for cache, old in zip(kv_caches, before):
        assert torch.equal(tokens_of(cache, C_BLOCKS, 0, 511), tokens_of(cache, A_BLOCKS, 0, 511))
        others = [b for b in range(NUM_BLOCKS) if b not in C_BLOCKS[:32]]
        assert torch.equal(cache[:, others], old[:, others])
        assert torch.equal(tokens_of(cache, C_BLOCKS, 511, 512),
                           tokens_of(old, C_BLOCKS, 511, 512))


@pytest.mark.parametrize("num_tokens", [600, 590], ids=["tail-of-full-blocks",
                                                        "tail-inside-a-block"])
def test_a_partial_tail_loads_every_token_but_the_last(
        saver: KvSaver, loader: KvLoader, store: KvStore, num_tokens: int) -> None:
    """A prompt the store holds to its end, the last chunk partial: every token but the last
    is loaded into the request's slots, token by token in its last block."""
    kv_caches = caches()
    prompt = PROMPT[:num_tokens]
    batch = new_batch()
    scheduled = batch.apply(StepInput(0, [NewRequest("a", prompt, num_tokens, GREEDY,
                                                     [A_BLOCKS], 0, num_tokens)], [], []))
    saver.submit(saver.copy_out(scheduled, kv_caches, BLOCK_SIZE), BLOCK_SIZE)
    drain(saver)
    before = [cache.clone() for cache in kv_caches]
    num_blocks = -(-(num_tokens - 1) // BLOCK_SIZE)
    step = StepInput(1, [loading("c", 128, num_tokens - 1 - 128, C_BLOCKS[:num_blocks],
                                 token_ids=prompt)], [], [])
    batch = new_batch()
    assert batch.apply(step) == []
    ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
    assert ticket is not None and ticket.wait() == {"c": num_tokens - 1 - 128}
    assert loader.num_chunks_loaded == 3 and loader.num_loads_short == 0
    for cache, old in zip(kv_caches, before):
        assert torch.equal(tokens_of(cache, C_BLOCKS, 128, num_tokens - 1),
                           tokens_of(cache, A_BLOCKS, 128, num_tokens - 1))
        assert torch.equal(tokens_of(cache, C_BLOCKS, 0, 128), tokens_of(old, C_BLOCKS, 0, 128))
        if (num_tokens - 1) % BLOCK_SIZE:   # the rest of the last block is untouched
            assert torch.equal(tokens_of(cache, C_BLOCKS, num_tokens - 1, num_blocks * 16),
                               tokens_of(old, C_BLOCKS, num_tokens - 1, num_blocks * 16))


@pytest.mark.parametrize("missing, num_loaded", [(1, 256), (0, 0)],
                         ids=["second-chunk-gone", "first-chunk-gone"])
def test_a_missing_chunk_ends_the_load(saver: KvSaver, loader: KvLoader, store: KvStore,
                                       missing: int, num_loaded: int) -> None:
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    assert store.tiers[0].remove(keys(PROMPT)[missing])   # evicted since the admission
    before = [cache.clone() for cache in kv_caches]
    assert load_c(loader, kv_caches, 0, 512) == {"c": num_loaded}
    assert_loaded(kv_caches, before, 0, num_loaded // BLOCK_SIZE)
    assert loader.num_loads_short == 1


def test_chunks_of_another_layout_are_not_loaded(saver: KvSaver, loader: KvLoader,
                                                 store: KvStore) -> None:
    """Chunks whose shape does not match this rank's cache (same keys) load nothing."""
    save_a(saver, caches(), store)
    kv_caches = caches(num_heads=NUM_HEADS + 1)
    before = [cache.clone() for cache in kv_caches]
    assert load_c(loader, kv_caches, 0, 512) == {"c": 0}
    for cache, old in zip(kv_caches, before):
        assert torch.equal(cache, old)


def client_timing_out_after(timeout_ms: int) -> type[KvStoreClient]:
    """The loader's client class, with a short timeout (a call to a silent store)."""
    class Client(KvStoreClient):
        def __init__(self, ctx: zmq.Context, address: str, **kw: object) -> None:
            super().__init__(ctx, address, timeout_ms=timeout_ms, **kw)  # type: ignore[arg-type]

    return Client


def test_a_store_that_does_not_answer_loads_nothing_and_raises_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_loader, "KvStoreClient", client_timing_out_after(200))
    with zmq.Context() as probe_ctx, probe_ctx.socket(zmq.ROUTER) as probe:
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    # Nothing listens on the port any more; the store answered once (chunk_tokens known).
    gone = cast(KvSaver, SimpleNamespace(address=f"tcp://127.0.0.1:{port}",
                                         chunk_tokens=CHUNK_TOKENS, kv_slice=SLICE))
    loader = KvLoader(gone, codec=client_codec())
    try:
        kv_caches = caches()
        before = [cache.clone() for cache in kv_caches]
        started = time.monotonic()
        assert load_c(loader, kv_caches, 0, 512) == {"c": 0}
        assert time.monotonic() - started < 5
        assert loader.num_loads_short == 1 and loader.num_tokens_loaded == 0
        for cache, old in zip(kv_caches, before):
            assert torch.equal(cache, old)
    finally:
        loader.close()


def test_a_step_that_finishes_a_loading_request_waits_for_its_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads run across steps; only a step naming the loading request in finished_ids (its
    blocks may be handed out by that step) waits for the load, another step does not."""
    monkeypatch.setattr(kv_loader, "KvStoreClient", client_timing_out_after(600))
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:   # takes, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        slow = cast(KvSaver, SimpleNamespace(address=f"tcp://127.0.0.1:{port}",
                                             chunk_tokens=CHUNK_TOKENS, kv_slice=SLICE))
        loader = KvLoader(slow, codec=client_codec())
        try:
            batch = new_batch()
            step = StepInput(1, [loading("c", 0, 512, C_BLOCKS[:32])], [], [])
            batch.apply(step)
            ticket = loader.start(step, batch.requests, caches(), BLOCK_SIZE)
            assert ticket is not None and not ticket.done
            started = time.monotonic()
            loader.wait_for(["other"])
            assert not ticket.done and time.monotonic() - started < 0.3
            loader.wait_for(["other", "c"])
            assert ticket.done and ticket.wait() == {"c": 0}
            report = ticket.report("w0")
            assert (report.step_id, report.request_ids, report.num_loaded_tokens) == (
                1, ["c"], [0])
        finally:
            loader.close()


@pytest.mark.parametrize("chunk_tokens", [None, 200], ids=["store-not-known", "no-whole-blocks"])
def test_a_store_of_unknown_or_unusable_chunks_loads_nothing(chunk_tokens: int | None) -> None:
    unknown = cast(KvSaver, SimpleNamespace(address="tcp://127.0.0.1:1",
                                            chunk_tokens=chunk_tokens, kv_slice=SLICE))
    loader = KvLoader(unknown, codec=client_codec())
    try:
        assert load_c(loader, caches(), 0, 512) == {"c": 0}
    finally:
        loader.close()


def test_a_step_without_loads_has_no_ticket(loader: KvLoader) -> None:
    batch = new_batch()
    step = StepInput(0, [NewRequest("a", PROMPT, 600, GREEDY, [A_BLOCKS], 0, 600)], [], [])
    batch.apply(step)
    assert loader.start(step, batch.requests, caches(), BLOCK_SIZE) is None


# --------------------------------------------------------------------------- input batch


def test_a_new_request_computes_or_loads_or_both_never_neither() -> None:
    batch = new_batch()
    with pytest.raises(ValueError, match="computes tokens or loads them"):
        batch.apply(StepInput(0, [loading("c", 0, 0, C_BLOCKS, num_new=0)], [], []))
    with pytest.raises(ValueError, match="only 600 are known"):     # the rest is too long
        batch.apply(StepInput(0, [loading("c", 0, 512, C_BLOCKS, num_new=89)], [], []))
    with pytest.raises(ValueError, match="cannot hold"):      # blocks cover the load
        batch.apply(StepInput(0, [loading("c", 0, 512, C_BLOCKS[:31])], [], []))
    with pytest.raises(ValueError, match="only 600 are known"):
        batch.apply(StepInput(0, [loading("c", 256, 512, C_BLOCKS)], [], []))
    assert not batch.requests
    # A layer-wise load: the step computes the rest after the loaded tokens, and samples.
    [scheduled] = batch.apply(StepInput(0, [loading("c", 128, 384, C_BLOCKS, num_new=88)],
                                        [], []))
    assert (scheduled.num_computed_tokens, scheduled.num_new_tokens, scheduled.samples) == (
        512, 88, True)
    state = batch.requests["c"]
    assert (state.load_start, state.num_computed_tokens) == (128, 600)


def resume(num_computed: int) -> StepInput:
    """Request "c" (loaded into C_BLOCKS[:32]) computes the rest of PROMPT from
    `num_computed`, with the blocks for it."""
    return StepInput(2, [], [RunningRequest("c", num_computed, 600 - num_computed,
                                            [C_BLOCKS[32:]], [])], [])


@pytest.mark.parametrize("at", [128, 129, 256, 400, 512])
def test_after_a_load_the_request_resumes_anywhere_within_it(at: int) -> None:
    batch = new_batch()
    batch.apply(StepInput(1, [loading("c", 128, 384, C_BLOCKS[:32])], [], []))
    [scheduled] = batch.apply(resume(at))
    assert (scheduled.num_computed_tokens, scheduled.num_new_tokens, scheduled.samples) == (
        at, 600 - at, True)
    state = batch.requests["c"]
    assert state.load_start is None and state.num_computed_tokens == 600
    assert state.block_ids == [C_BLOCKS[:38]]
    # Once resumed, it is exact again.
    with pytest.raises(ValueError, match="has computed 600"):
        batch.apply(StepInput(3, [], [RunningRequest("c", 599, 1, [[]], [])], []))


@pytest.mark.parametrize("at", [127, 0, 513])
def test_a_resume_outside_the_load_is_refused_and_changes_nothing(at: int) -> None:
    batch = new_batch()
    batch.apply(StepInput(1, [loading("c", 128, 384, C_BLOCKS[:32])], [], []))
    with pytest.raises(ValueError, match="num_computed_tokens"):
        batch.apply(resume(at))
    state = batch.requests["c"]
    assert (state.load_start, state.num_computed_tokens) == (128, 512)
    assert state.block_ids == [C_BLOCKS[:32]]
    [scheduled] = batch.apply(resume(128))            # still resumable
    assert scheduled.num_computed_tokens == 128


def test_a_request_finished_while_loading_is_dropped() -> None:
    batch = new_batch()
    batch.apply(StepInput(1, [loading("c", 0, 512, C_BLOCKS[:32])], [], []))
    batch.apply(StepInput(2, [], [], ["c"]))
    assert not batch.requests
    with pytest.raises(ValueError, match="not held"):
        batch.apply(resume(256))
