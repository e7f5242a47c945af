"""The KV loader's ordering against the compute stream (CUDA events both ways), shown on a CPU
with a recording twin of `StreamOrder`: the loader's stream waits for an event recorded on the
compute stream when the load started, every copy runs inside that wait, and the compute
stream joins the loader's event only once the load is done, before the next forward. The
loads themselves are real (a real KV store on a TCP socket, real chunks, real blocks)."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvcache_svc.kv_store.store import KvStore
from services.wire import StepInput
from tests.kvcache_svc.kv_store.serving import client_codec
from tests.worker_svc.test_kv_loader import (  # noqa: F401  (fixtures)
    A_BLOCKS,
    BLOCK_SIZE,
    C_BLOCKS,
    address,
    caches,
    loading,
    new_batch,
    save_a,
    saver,
    store,
)
from worker_svc import kv_loader
from worker_svc.kv_loader import KvLoader
from worker_svc.kv_saver import KvSaver


class RecordingOrder:
    """`StreamOrder`'s methods, recording (call, thread, event) instead of touching CUDA."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.inside = False              # a copy now would run on the loader's stream
        self.hold = threading.Event()    # the loader's copies wait for this
        self.hold.set()

    def _record(self, name: str, event: object = None) -> None:
        self.calls.append((name, threading.current_thread().name, event))

    def mark_ready(self) -> object:
        event = object()
        self._record("ready", event)
        return event

    @contextmanager
    def copying(self, ready: object) -> Iterator[None]:
        self._record("wait", ready)
        self.hold.wait(10)
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def mark_copied(self) -> object:
        event = object()
        self._record("copied", event)
        return event

    def mark_group(self) -> object:
        event = object()
        self._record("group" if self.inside else "group outside the loader's stream", event)
        return event

    def join(self, copied: object) -> None:
        self._record("join", copied)


@pytest.fixture
def order(monkeypatch: pytest.MonkeyPatch) -> RecordingOrder:
    recording = RecordingOrder()
    real_scatter = kv_loader.scatter_tokens

    def scatter(*args, **kwargs):  # type: ignore[no-untyped-def]
        recording._record("copy" if recording.inside else "copy outside the loader's stream")
        return real_scatter(*args, **kwargs)

    monkeypatch.setattr(kv_loader, "scatter_tokens", scatter)
    return recording


def test_loads_wait_for_the_compute_stream_and_the_compute_stream_for_them(
        saver: KvSaver, store: KvStore, order: RecordingOrder) -> None:  # noqa: F811
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    loader = KvLoader(saver, codec=client_codec(), order=order)  # type: ignore[arg-type]
    try:
        batch = new_batch()
        step = StepInput(1, [loading("c", 0, 512, C_BLOCKS[:32])], [], [])
        batch.apply(step)
        order.hold.clear()                      # the loader is stuck before its copies
        ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
        assert ticket is not None and not ticket.done
        loader.join_loads()                     # a step launched meanwhile: nothing to join
        assert [c[0] for c in order.calls if c[0] == "join"] == []
        order.hold.set()
        assert ticket.wait() == {"c": 512}
        loader.join_loads()                     # the next launch joins the finished load
        loader.join_loads()                     # and only once
    finally:
        loader.close()
    names = [name for name, _, _ in order.calls]
    assert names == ["ready", "wait", "copy", "copy", "copied", "join"], names
    (ready, step_thread, ready_event), (_, loader_thread, waited) = order.calls[:2]
    assert waited is ready_event and step_thread == threading.current_thread().name
    assert loader_thread == "kv-loader"
    copied_event, joined = order.calls[-2][2], order.calls[-1][2]
    assert joined is copied_event and order.calls[-1][1] == step_thread
    for layer in kv_caches:                     # the copies were real
        assert torch.equal(layer[:, C_BLOCKS[:32]], layer[:, A_BLOCKS[:32]])


def test_each_layer_waits_for_its_groups_copies_on_the_compute_stream(
        saver: KvSaver, store: KvStore, order: RecordingOrder) -> None:  # noqa: F811
    """A layer-wise load: the loader records an event after each layer group's copies, and
    the step's thread makes the compute stream join that event before the group's layers."""
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    loader = KvLoader(saver, codec=client_codec(), order=order)  # type: ignore[arg-type]
    try:
        batch = new_batch()
        step = StepInput(1, [loading("c", 0, 599, C_BLOCKS, num_new=1)], [], [])
        batch.apply(step)
        ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
        assert ticket is not None and ticket.layer_ends == [1, 2, 3]
        for layer in range(len(kv_caches)):
            ticket.wait_layer(layer)
        assert ticket.inline_loaded() == {"c": 599}
        ticket.wait()
    finally:
        loader.close()
    names = [name for name, _, _ in order.calls]
    assert names[:2] == ["ready", "wait"] and names.count("copied") == 1, names
    groups = [(i, event) for i, (name, _, event) in enumerate(order.calls) if name == "group"]
    joins = [(i, event, thread) for i, (name, thread, event) in enumerate(order.calls)
             if name == "join"]
    assert len(groups) == len(joins) == 3, names
    step_thread = threading.current_thread().name
    previous = 0
    for (made, event), (joined, waited, thread) in zip(groups, joins, strict=True):
        assert waited is event and made < joined and thread == step_thread
        # Every copy of the group (3 chunks) came before its event, after the last group's.
        assert names[previous:made].count("copy") == 3, names
        previous = made
    assert "copy outside the loader's stream" not in names


def test_a_cpu_cache_needs_no_stream_order(saver: KvSaver, store: KvStore) -> None:  # noqa: F811
    kv_caches = caches()
    save_a(saver, kv_caches, store)
    loader = KvLoader(saver, codec=client_codec())
    try:
        batch = new_batch()
        step = StepInput(1, [loading("c", 0, 256, C_BLOCKS[:16])], [], [])
        batch.apply(step)
        ticket = loader.start(step, batch.requests, kv_caches, BLOCK_SIZE)
        assert ticket is not None and ticket.wait() == {"c": 256}
        assert ticket.ready is None and ticket.copied is None
        loader.join_loads()
    finally:
        loader.close()
