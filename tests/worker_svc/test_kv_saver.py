"""KvSaver: a real ModelRunner (SmolLM2, CPU) saving its computed KV to a real KV store served
on a TCP socket; chunks equal the cache's content, held chunks are not sent again, a full
queue skips, and the chunk keys use the scheduler's block hashes."""

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from scheduler_svc.engine.request import Request, SamplingParams
from services.block_hash import hash_full_blocks
from services.kv_chunks import KvSlice, chunk_keys, prefix_chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_tensors import load_tensors
from services.model_config import ModelConfig
from services.wire import NewRequest, StepInput, StepOutput
from tests.kvcache_svc.kv_store.serving import client_codec, serving
from tests.worker_svc.common import GREEDY
from tests.worker_svc.test_runner import BLOCK_SIZE, MiniScheduler
from worker_svc.input_batch import InputBatch
from worker_svc.kv_saver import KvSaver, KvStoreOptions, extend_block_hashes, gather_tokens
from worker_svc.runner import ModelRunner

CHUNK_TOKENS = 256
NUM_BLOCKS = 1024
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def runner(model_path: Path, model_config: ModelConfig) -> ModelRunner:
    """A runner without a store: what saving must not change."""
    return ModelRunner(model_config, model_path, torch.float32, "worker-0")


@pytest.fixture
def address(ctx: zmq.Context) -> Iterator[str]:
    with serving(ctx, KvStore([MemoryTier(256 << 20)], chunk_tokens=CHUNK_TOKENS)) as loop:
        yield loop.address


@pytest.fixture
def client(ctx: zmq.Context, address: str) -> Iterator[KvStoreClient]:
    store_client = KvStoreClient(ctx, address, codec=client_codec())
    yield store_client
    store_client.close()


def _saving_runner(model_path: Path, model_config: ModelConfig, address: str,
                   max_queued_chunks: int = 32) -> tuple[ModelRunner, KvSaver]:
    """A runner built with the store at `address`, and its saver once the store answered."""
    runner = ModelRunner(model_config, model_path, torch.float32, "worker-0",
                         kv_store=KvStoreOptions(address, max_queued_chunks, client_codec()))
    saver = runner.kv_saver
    assert saver is not None and saver.ready.wait(10), "the store never described itself"
    assert saver.chunk_tokens == CHUNK_TOKENS
    return runner, saver


def _prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()


def _run(runner: ModelRunner, scheduler: MiniScheduler) -> None:
    while scheduler.has_work:
        output = runner.execute(scheduler.schedule())
        assert isinstance(output, StepOutput)
        scheduler.update(output)


def _drain(saver: KvSaver) -> None:
    deadline = time.monotonic() + 20
    while saver.num_queued_chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.num_queued_chunks == 0


def _cached_tokens(runner: ModelRunner, block_ids: list[int], start: int, end: int
                   ) -> torch.Tensor:
    """Tokens [start, end) of a request, read from the paged cache: [layers, 2, tokens, heads,
    dim]."""
    blocks = block_ids[:-(-end // BLOCK_SIZE)]
    return torch.stack([cache[:, blocks].reshape(2, -1, *cache.shape[3:])[:, start:end]
                        for cache in runner.kv_caches])


def _keys(token_ids: list[int], kv_slice: KvSlice) -> list:
    return chunk_keys(hash_full_blocks(token_ids, BLOCK_SIZE), BLOCK_SIZE, CHUNK_TOKENS,
                      kv_slice)


def _tail_key(token_ids: list[int], kv_slice: KvSlice):  # type: ignore[no-untyped-def]
    """The key of the partial chunk that ends at the last of `token_ids`."""
    end = len(token_ids)
    return prefix_chunk_keys(hash_full_blocks(token_ids, BLOCK_SIZE), token_ids, end - 1, end,
                             BLOCK_SIZE, CHUNK_TOKENS, kv_slice)[-1]


def _stored_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "stored KV" in r.getMessage()]


def test_saves_whole_chunks_and_only_new_ones(runner: ModelRunner, model_path: Path,
                                             model_config: ModelConfig, address: str,
                                             client: KvStoreClient,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="worker_svc.kv_saver")
    prompt = _prompt(600, model_config.vocab_size, seed=1)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    plain = MiniScheduler(token_budget=2048, send_tokens=False)
    plain.add("a", prompt, MAX_TOKENS)
    _run(runner, plain)

    runner, saver = _saving_runner(model_path, model_config, address)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    try:
        # Chunked prefill (steps of 200 tokens): chunk ends fall inside steps.
        scheduler = MiniScheduler(token_budget=200, send_tokens=False)
        scheduler.add("a", prompt, MAX_TOKENS)
        _run(runner, scheduler)
        _drain(saver)
        assert scheduler.outputs("a") == plain.outputs("a")     # saving changes nothing
        # Steps [0, 200), [200, 400), [400, 600): a partial chunk, then its extension to the
        # full chunk 0 and a partial chunk, then chunk 1 and the prompt's tail [512, 600).
        assert (saver.num_chunks_stored, saver.num_tokens_stored) == (5, 600)
        assert _stored_lines(caplog)[-1] == (
            "stored KV for 200 of 600 tokens (skip_leading_tokens=400)")
        keys = _keys(prompt, runner.kv_slice())
        assert len(keys) == 2 and client.lookup(keys) == 2
        loaded = load_tensors(client, [*keys, _tail_key(prompt, runner.kv_slice())])
        block_ids = scheduler.requests["a"].block_ids
        for index, tensor in enumerate(loaded):
            assert tensor is not None
            start = index * CHUNK_TOKENS
            expected = _cached_tokens(runner, block_ids, start, min(start + CHUNK_TOKENS, 600))
            assert torch.equal(tensor, expected)

        # Sharing the first 512 tokens: what the store holds is not sent again.
        caplog.clear()
        longer = prompt[:512] + _prompt(300, model_config.vocab_size, seed=2)
        scheduler.add("b", longer, MAX_TOKENS)
        _run(runner, scheduler)
        _drain(saver)
        assert _stored_lines(caplog) == [
            "stored KV for 0 of 200 tokens (skip_leading_tokens=200)",
            "stored KV for 0 of 400 tokens (skip_leading_tokens=400)",
            "stored KV for 88 of 600 tokens (skip_leading_tokens=512)",
            "stored KV for 200 of 800 tokens (skip_leading_tokens=600)",
            "stored KV for 12 of 812 tokens (skip_leading_tokens=800)"]
        assert (saver.num_chunks_stored, saver.num_chunks_held) == (9, 0)
        assert client.lookup(_keys(longer, runner.kv_slice())) == 3
        assert client.lookup([_tail_key(longer, runner.kv_slice())]) == 1
        assert saver.num_saves_skipped == saver.num_chunks_failed == 0

        # A prefix hit on a's first 512 tokens: the cached chunks are not even copied out.
        caplog.clear()
        other = prompt[:512] + _prompt(300, model_config.vocab_size, seed=4)
        block_ids = scheduler.requests["a"].block_ids[:512 // BLOCK_SIZE] + list(
            range(900, 900 + 300 // BLOCK_SIZE))
        runner.execute(StepInput(100, [NewRequest("c", other, len(other), GREEDY, [block_ids],
                                                  512, 300)], [], []))
        _drain(saver)
        assert saver.num_chunks_stored == 11           # chunk [512, 768), tail [768, 812)
        assert _stored_lines(caplog) == [
            "stored KV for 300 of 812 tokens (skip_leading_tokens=512)"]
    finally:
        runner.close()


def test_the_seeds_32_tokens_in_prefill_chunks_of_24_and_8(
        model_path: Path, model_config: ModelConfig, address: str, client: KvStoreClient,
        caplog: pytest.LogCaptureFixture) -> None:
    """A prompt shorter than a chunk is stored as a partial chunk; the next prefill chunk sends
    only its 8 new tokens, and the store holds the 32 tokens' KV exactly as computed."""
    caplog.set_level(logging.INFO, logger="worker_svc.kv_saver")
    prompt = _prompt(32, model_config.vocab_size, seed=7)
    runner, saver = _saving_runner(model_path, model_config, address)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    try:
        scheduler = MiniScheduler(token_budget=24, send_tokens=False)
        scheduler.add("a", prompt, 1)
        _run(runner, scheduler)
        _drain(saver)
        assert _stored_lines(caplog) == [
            "stored KV for 24 of 24 tokens (skip_leading_tokens=0)",
            "stored KV for 8 of 32 tokens (skip_leading_tokens=24)"]
        assert (saver.num_chunks_stored, saver.num_tokens_stored) == (2, 32)
        key = _tail_key(prompt, runner.kv_slice())
        assert key.num_tokens == 32
        [loaded] = load_tensors(client, [key])
        assert loaded is not None
        assert torch.equal(loaded, _cached_tokens(runner, scheduler.requests["a"].block_ids,
                                                  0, 32))
    finally:
        runner.close()


def test_full_queue_skips_and_counts(model_path: Path, model_config: ModelConfig,
                                     address: str) -> None:
    runner, saver = _saving_runner(model_path, model_config, address, max_queued_chunks=1)
    runner.init_cache(NUM_BLOCKS, BLOCK_SIZE)
    try:
        scheduler = MiniScheduler(token_budget=2048, send_tokens=False)
        scheduler.add("a", _prompt(600, model_config.vocab_size, seed=3), 1)
        _run(runner, scheduler)      # one step completes two chunks and a tail: room for one
        _drain(saver)
        assert (saver.num_chunks_stored, saver.num_saves_skipped) == (1, 2)
    finally:
        runner.close()


@pytest.mark.parametrize("salt", [b"", b"tenant-7"])
def test_block_hashes_match_the_schedulers(salt: bytes) -> None:
    prompt = list(range(1, 70))
    request = Request("r", prompt, SamplingParams(max_tokens=4), (0,), 1024, BLOCK_SIZE,
                      hash_blocks=True, cache_salt=salt)
    batch = InputBatch(64, BLOCK_SIZE, 1000, 1024)
    [scheduled] = batch.apply(StepInput(0, [NewRequest(
        "r", prompt, len(prompt), GREEDY, [list(range(1, 19))], 0, len(prompt),
        cache_salt=salt)], [], []))
    state = scheduled.state
    assert state.cache_salt == salt
    assert extend_block_hashes(state, 32, BLOCK_SIZE)          # incrementally, as chunks end
    assert extend_block_hashes(state, 68, BLOCK_SIZE)
    assert state.block_hashes == request.block_hashes
    state.token_ids += [-1, 5, 5]                              # a token not read back yet
    assert not extend_block_hashes(state, 72, BLOCK_SIZE)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_gather_tokens_copies_tokens_of_every_layer(device: str) -> None:
    """The copy out of the paged cache, from a token inside a block, on the step's stream on a
    GPU (pinned buffer)."""
    caches = [torch.randn(2, 9, BLOCK_SIZE, 3, 8, device=device) for _ in range(4)]
    blocks = [7, 2, 5]
    first, num_tokens = 1, 2 * BLOCK_SIZE          # from inside block 7, into block 5
    buffer = torch.empty(4, 2, num_tokens, 3, 8, pin_memory=device == "cuda")
    gather_tokens(caches, [blocks], first, buffer)
    if device == "cuda":
        torch.cuda.synchronize()
    for layer, cache in enumerate(caches):
        expected = cache.cpu()[:, blocks].reshape(2, 3 * BLOCK_SIZE, 3, 8)
        assert torch.equal(buffer[layer], expected[:, first:first + num_tokens])
