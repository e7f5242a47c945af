"""Layer-wise KV loads (issue 24, point 2): the store serves a range of layers of a chunk, the
loader fetches a load group of layers by group and releases each group to the forward as it
lands, and `settle_inline_loads` agrees on the counts and rolls a short load back. A real KV
store on a TCP socket, chunks saved by a real KvSaver (fixtures and helpers of
test_kv_loader.py); the model-level check is in test_kv_loader_model.py."""

import time
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import zmq

from kvcache_svc.kv_store.store import KvStore
from services.kv_chunks import layer_range
from services.kv_store_client import KvStoreClient
from services.wire import StepInput
from tests.kvcache_svc.kv_store.serving import client_codec
from tests.worker_svc import test_kv_loader as base
from tests.worker_svc.test_kv_loader import (
    A_BLOCKS,
    BLOCK_SIZE,
    C_BLOCKS,
    NUM_LAYERS,
    PROMPT,
    caches,
    keys,
    loading,
    new_batch,
    save_a,
    tokens_of,
)
from worker_svc import kv_loader
from worker_svc.kv_loader import KvLoader, not_sampling, settle_inline_loads
from worker_svc.kv_saver import KvSaver
from worker_svc.load_ticket import LoadTicket, layer_group_ends
from worker_svc.model.tensor_parallel import TpGroup

DELAY_S = 0.15          # per message of a slowed client

# test_kv_loader.py's fixtures: a real store served on TCP, its saver and a loader.
store, address, saver, loader = base.store, base.address, base.saver, base.loader


def test_layer_groups_split_the_layers_evenly() -> None:
    assert layer_group_ends(30, 6) == [5, 10, 15, 20, 25, 30]
    assert layer_group_ends(3, 6) == [1, 2, 3]
    assert layer_group_ends(7, 3) == [2, 4, 7]
    assert layer_group_ends(1, 6) == [1]


def test_the_store_serves_a_range_of_a_chunks_layers(saver: KvSaver, store: KvStore,
                                                     address: str) -> None:
    save_a(saver, caches(), store)
    whole = store.get(keys(PROMPT)[0])
    assert whole is not None and whole.header.shape[0] == NUM_LAYERS
    layer_bytes = whole.num_bytes // NUM_LAYERS
    with zmq.Context() as ctx:
        client = KvStoreClient(ctx, address, codec=client_codec())
        try:
            [part, gone] = client.load([keys(PROMPT)[0], keys(PROMPT[:16] * 40)[0]], (1, 3))
            assert gone is None and part is not None
            assert part.header.shape == (2, *whole.header.shape[1:])
            assert bytes(part.data) == bytes(whole.data)[layer_bytes:3 * layer_bytes]
            assert client.load([keys(PROMPT)[0]], (2, NUM_LAYERS + 1)) == [None]  # too few
            [again] = client.load([keys(PROMPT)[0]], (0, NUM_LAYERS))
            assert again is not None and bytes(again.data) == bytes(whole.data)
        finally:
            client.close()
    assert layer_range(whole, 1, 1) is None


def slowed(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every client load takes DELAY_S longer; returns the list its calls' starts go into."""
    starts: list[float] = []
    real = KvStoreClient.load

    def load(self: KvStoreClient, *args: object, **kw: object) -> object:
        starts.append(time.monotonic())
        time.sleep(DELAY_S)
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(KvStoreClient, "load", load)
    return starts


def start_layerwise(loader: KvLoader, kv_caches: list[torch.Tensor], num_load: int = 599,
                    ) -> tuple[LoadTicket, object]:
    """Request "c" (PROMPT, in C_BLOCKS) loads `num_load` tokens and computes the rest."""
    batch = new_batch()
    step = StepInput(1, [loading("c", 0, num_load, C_BLOCKS, num_new=600 - num_load)], [], [])
    scheduled = batch.apply(step)
    ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
    assert ticket is not None and ticket.inline_ids == ["c"]
    assert ticket.layer_ends == list(range(1, NUM_LAYERS + 1))
    return ticket, scheduled


def test_each_layer_is_released_as_its_group_lands(saver: KvSaver, loader: KvLoader,
                                                   store: KvStore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    before = [cache.clone() for cache in kv_caches]
    starts = slowed(monkeypatch)
    began = time.monotonic()
    ticket, _ = start_layerwise(loader, kv_caches)
    released = []
    for layer in range(NUM_LAYERS):
        ticket.wait_layer(layer)
        released.append(time.monotonic() - began)
        # This layer holds A's KV for every loaded token; the rest of its blocks are as
        # they were (the last token's slot is left to the step's compute).
        cache = kv_caches[layer]
        assert torch.equal(tokens_of(cache, C_BLOCKS, 0, 599), tokens_of(cache, A_BLOCKS, 0, 599))
        assert torch.equal(tokens_of(cache, C_BLOCKS, 599, 608),
                           tokens_of(before[layer], C_BLOCKS, 599, 608))
    assert ticket.inline_loaded() == {"c": 599}
    assert len(starts) == NUM_LAYERS            # one message per layer group
    # Layer 0 was released about one message in, while the last group was still to come.
    assert released[0] < released[-1] - 1.5 * DELAY_S, released
    ticket.wait()
    assert ticket.report("w").num_loaded_tokens == [599]
    stats = store.stats()
    whole = sum(chunk.num_bytes for chunk in (store.get(k) for k in store.tiers[0].keys())
                if chunk is not None)
    assert (stats.num_loaded_chunks, stats.num_loaded_tokens) == (3, 600)   # counted once
    assert stats.num_loaded_bytes == whole and loader.num_chunks_loaded == 3


class LowerRank:
    """A TP group whose other rank got less than this one."""

    def __init__(self, other: list[int]) -> None:
        self.other = other

    def agree_min(self, values: list[int], device: torch.device) -> list[int]:
        return [min(a, b) for a, b in zip(values, self.other, strict=True)]


@pytest.mark.parametrize("lost, tp_other, num_loaded", [
    (None, None, 599), (1, None, 256), (0, None, 0), (None, [256], 256)],
    ids=["full", "second-chunk-lost", "first-chunk-lost", "other-tp-rank-short"])
def test_settling_rolls_a_short_load_back(saver: KvSaver, loader: KvLoader, store: KvStore,
                                          lost: int | None, tp_other: list[int] | None,
                                          num_loaded: int) -> None:
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    if lost is not None:
        assert store.tiers[0].remove(keys(PROMPT)[lost])
    ticket, scheduled = start_layerwise(loader, kv_caches)
    for layer in range(NUM_LAYERS):
        ticket.wait_layer(layer)
    tp = None if tp_other is None else cast(TpGroup, LowerRank(tp_other))
    short = settle_inline_loads(ticket, scheduled, tp, torch.device("cpu"))
    [s] = scheduled
    assert short == ({"c"} if num_loaded < 599 else set())
    assert ticket.loaded == {"c": num_loaded}         # what this rank reports: the agreed count
    assert s.state.num_computed_tokens == (600 if num_loaded == 599 else num_loaded)
    [after] = not_sampling(scheduled, short)
    assert after.samples == (num_loaded == 599)


def test_a_load_without_a_store_is_short_and_releases_every_layer() -> None:
    unknown = cast(KvSaver, SimpleNamespace(address="tcp://127.0.0.1:1", chunk_tokens=None,
                                            kv_slice=None))
    unknown_loader = KvLoader(unknown, codec=client_codec())
    try:
        batch = new_batch()
        step = StepInput(1, [loading("c", 0, 599, C_BLOCKS, num_new=1)], [], [])
        scheduled = batch.apply(step)
        ticket = unknown_loader.start(step, batch.requests, caches(), BLOCK_SIZE)
        assert ticket is not None and ticket.done
        for layer in range(NUM_LAYERS):
            ticket.wait_layer(layer)                  # returns at once
        assert settle_inline_loads(ticket, scheduled, None, torch.device("cpu")) == {"c"}
        # Without any loader (no store configured) the same.
        bare = kv_loader.start_loads(None, step, batch, caches())
        assert bare is not None and bare.inline_ids == ["c"] and bare.inline_loaded() == {"c": 0}
    finally:
        unknown_loader.close()
