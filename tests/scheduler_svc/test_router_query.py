"""The router's prefix query never blocks the event loop that streams every client's tokens:
with a kvcache_svc that answers slowly, `dispatch` returns at once, other coroutines keep
running, and the request still lands on the replica holding its prefix; after a query times
out, routing goes by load alone for a while instead of asking again per request."""

import asyncio
import threading
import time

import pytest

from scheduler_svc import router as router_module
from scheduler_svc.request import Request, SamplingParams
from scheduler_svc.router import Router
from services.kv_wire import (
    PrefixReply,
    ReplicaPrefix,
)
from tests.scheduler_svc.fakes import FakeEngine, add_replica

SLOW_S = 0.5    # how long the fake kvcache_svc takes to answer a prefix query


class SlowKv:
    """Stands in for the router's RequestClient to a slow kvcache_svc: replica 1 holds the
    prefix. `answer=False`: it times out (None), as the real client does."""

    def __init__(self, answer: bool = True) -> None:
        self.answer = answer
        self.num_calls = 0
        self.threads: set[str] = set()

    def call(self, message: object, timeout_ms: int) -> PrefixReply | None:
        self.num_calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(SLOW_S)
        if not self.answer:
            return None
        return PrefixReply(epoch=1, replicas=[ReplicaPrefix(0, 0, 0), ReplicaPrefix(1, 20, 0)])

    def close(self) -> None:
        pass


def request(request_id: str, num_tokens: int = 400) -> Request:
    r = Request(request_id, list(range(100, 100 + num_tokens)),
                SamplingParams(temperature=0.0, max_tokens=4), (2,), 4096, 16, hash_blocks=True)
    r.deadline = 1e12
    return r


def wait_until(predicate, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_slow_prefix_query_does_not_block_the_event_loop(router: Router) -> None:
    a, b = FakeEngine(0), FakeEngine(1)
    add_replica(router.membership, a)
    add_replica(router.membership, b)
    kv = SlowKv()
    router._route_kv = kv  # type: ignore[assignment]

    async def scenario() -> tuple[float, float]:
        """(longest gap between a ticking coroutine's ticks, time dispatch took)."""
        gaps: list[float] = []

        async def ticker() -> None:         # stands in for other clients' token streams
            last = time.monotonic()
            for _ in range(int(2 * SLOW_S / 0.01)):
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        r = request("r")
        router.live.add(r, lambda out: None)
        start = time.monotonic()
        router.dispatch(r)                   # on the loop, as the frontend calls it
        took = time.monotonic() - start
        await task
        return max(gaps), took

    longest_gap, took = asyncio.run(scenario())
    assert took < 0.05, f"dispatch waited {took:.3f} s for kvcache_svc"
    assert longest_gap < SLOW_S / 2, f"the event loop stalled {longest_gap:.3f} s"
    # The query still ran (off the loop) and routed the prompt to its cached prefix.
    assert wait_until(lambda: b.submitted == ["r"]), (a.submitted, b.submitted)
    assert a.submitted == [] and kv.num_calls == 1
    assert kv.threads and all(name.startswith("route-query") for name in kv.threads)


def test_after_a_timed_out_query_routing_goes_by_load_for_a_while(
        router: Router, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "QUERY_BACKOFF_S", 30.0)
    a, b = FakeEngine(0), FakeEngine(1)
    add_replica(router.membership, a)
    add_replica(router.membership, b)
    kv = SlowKv(answer=False)
    router._route_kv = kv  # type: ignore[assignment]
    first = request("first")
    router.live.add(first, lambda out: None)
    router.dispatch(first)
    assert wait_until(lambda: a.submitted + b.submitted == ["first"])
    assert kv.num_calls == 1
    # Within the backoff: no query at all, the request is placed at once, by load (replica 1
    # is idle, replica 0 has "first" if it went there; either way the less loaded one).
    second = request("second")
    router.live.add(second, lambda out: None)
    start = time.monotonic()
    router.dispatch(second)
    assert time.monotonic() - start < SLOW_S / 2
    assert kv.num_calls == 1
    assert sorted(a.submitted + b.submitted) == ["first", "second"]
    assert len(a.submitted) == len(b.submitted) == 1
