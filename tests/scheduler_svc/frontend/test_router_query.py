"""The router's prefix query never blocks the event loop that streams every client's tokens:
with a kvcache_svc that answers slowly, other coroutines keep running while a request is
routed (the query runs on the router's thread), and the request still lands on the replica
holding its prefix; a replica lost while the query was out is not chosen; after a query times
out, routing goes by load alone for a while instead of asking again per request."""

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from scheduler_svc.frontend import router as router_module
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.router import Router
from services.kv_wire import PrefixReply, ReplicaPrefix
from tests.scheduler_svc.frontend.fakes import (
    Client,
    FakeEngineLinks,
    cluster_state,
    make_router,
    placement_of,
    replace_kvcache,
    replica,
    settle,
    step_message,
)

SLOW_S = 0.3    # how long the fake kvcache_svc takes to answer a prefix query
A, B, C = replica(0), replica(1), replica(2)


@pytest.fixture
def router(ctx: zmq.Context) -> Iterator[Router]:
    """The front end's router, with prefix caching: prompts of a full block are queried."""
    r = make_router(ctx, prefix_caching=True)
    yield r
    r.close()


class SlowKv:
    """Stands in for the router's client of a slow kvcache_svc: replica 1 holds the prefix.
    `answer=False`: it times out (None), as the real client does."""

    def __init__(self, answer: bool = True) -> None:
        self.answer = answer
        self.num_calls = 0
        self.threads: set[str] = set()
        self.called = threading.Event()

    def call(self, message: object, timeout_ms: int) -> PrefixReply | None:
        self.num_calls += 1
        self.threads.add(threading.current_thread().name)
        self.called.set()
        time.sleep(SLOW_S)
        if not self.answer:
            return None
        return PrefixReply(epoch=1, replicas=[ReplicaPrefix(0, 0, 0), ReplicaPrefix(1, 20, 0),
                                              ReplicaPrefix(2, 0, 0)])

    def close(self) -> None:
        pass


def prepared(request_id: str) -> PreparedRequest:
    return PreparedRequest(request_id, list(range(100, 500)), SamplingParams(max_tokens=4))


async def until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def stop_all(clients: list[Client]) -> None:
    for client in clients:
        client.task.cancel()
    await asyncio.gather(*(c.task for c in clients), return_exceptions=True)


def test_a_slow_prefix_query_does_not_block_the_event_loop(
        frontend: Frontend, links: FakeEngineLinks, router: Router) -> None:
    kv = SlowKv()
    replace_kvcache(router, kv)

    async def scenario() -> float:
        """The longest gap between a ticking coroutine's ticks."""
        gaps: list[float] = []

        async def ticker() -> None:         # stands in for other clients' token streams
            last = time.monotonic()
            for _ in range(int(2 * SLOW_S / 0.01)):
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        frontend.take_state(cluster_state(A, B))
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        client = Client(frontend, prepared("r"))
        await task
        await until(lambda: links.requests())
        await stop_all([client])
        return max(gaps)

    longest_gap = asyncio.run(scenario())
    assert longest_gap < SLOW_S / 2, f"the event loop stalled {longest_gap:.3f} s"
    # The query ran (off the loop) and routed the prompt to its cached prefix.
    assert [where for where, _ in links.requests()] == [placement_of(B)]
    assert kv.num_calls == 1
    assert kv.threads and all(name.startswith("route-query") for name in kv.threads)


def test_a_replica_lost_while_the_query_was_out_is_not_chosen(
        frontend: Frontend, links: FakeEngineLinks, router: Router) -> None:
    kv = SlowKv()
    replace_kvcache(router, kv)

    async def run() -> None:
        frontend.take_state(cluster_state(A, B, C))
        client = Client(frontend, prepared("r"))
        await until(kv.called.is_set)
        # Replica 1, which holds the prefix, goes down before the answer comes.
        frontend.take_outputs(step_message(B, down="lost"))
        await until(lambda: links.requests())
        await stop_all([client])

    asyncio.run(run())
    assert [where for where, _ in links.requests()] == [placement_of(A)]


def test_after_a_timed_out_query_routing_goes_by_load_for_a_while(
        frontend: Frontend, links: FakeEngineLinks, router: Router,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "QUERY_BACKOFF_S", 30.0)
    kv = SlowKv(answer=False)
    replace_kvcache(router, kv)

    async def run() -> None:
        frontend.take_state(cluster_state(A, B))
        first = Client(frontend, prepared("first"))
        await until(lambda: links.requests())
        assert kv.num_calls == 1
        # Within the backoff: no query at all, the request is placed at once, by load.
        second = Client(frontend, prepared("second"))
        await settle()
        assert len(links.requests()) == 2
        await stop_all([first, second])

    asyncio.run(run())
    assert kv.num_calls == 1
    assert sorted(where for where, _ in links.requests()) == [placement_of(A), placement_of(B)]
