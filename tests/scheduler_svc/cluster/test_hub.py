"""The cluster's hub on real local sockets, with membership's engine cores faked: an engine
core's reports reach membership (the replica serves), a front end's report is answered with
the cluster's state and its stats query with the statistics; Abort by request id is relayed
to every other front end and answered once all answered (or ABORT_TIMEOUT_S passed); an
engine core told to stop gets EngineStop on its command socket."""

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from scheduler_svc.cluster.hub import ABORT_TIMEOUT_S, Hub
from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.wire import ClusterState, FrontendReport
from scheduler_svc.engine.wire import EngineReport, EngineStop, ToEngine
from scheduler_svc.frontend.links import ClusterLink
from services.channels import Receiver, Sender
from services.codec import Codec
from tests.scheduler_svc.cluster.fakes import (
    FakeEngines,
    form_replica,
    make_membership,
    proc,
    report,
)


@pytest.fixture
def membership(model_path: Path, ctx: zmq.Context) -> Iterator[Membership]:
    m = make_membership(model_path, ctx, FakeEngines(exit_on_stop=False))
    m.kv.reachable = True
    yield m
    for replica in m.replicas.values():     # the fake processes exit: no wait at shutdown
        if replica.engine is not None:
            proc(replica.engine).returncode = 0
    m.shutdown()


@pytest.fixture
def hub(ctx: zmq.Context, membership: Membership) -> Iterator[Hub]:
    h = Hub(ctx, "tcp://127.0.0.1:9", "info")
    h.membership = membership
    h.start()
    yield h
    h.shutdown()


def frontend_report(index: int, num_live: int = 0) -> FrontendReport:
    return FrontendReport(frontend=index, epoch=1, num_live=num_live, num_parked=0,
                          num_requests_total=10 * (index + 1), num_migrations=index)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_engine_reports_reach_membership(ctx: zmq.Context, hub: Hub,
                                         membership: Membership) -> None:
    replica = form_replica(membership, {"w0": 64})
    engine = replica.engine
    assert engine is not None
    sender = Sender(ctx, Codec(EngineReport), hub.reports.address)
    try:
        sender.send(report(engine))
        wait_until(lambda: bool(membership.cluster_state().ready))
    finally:
        sender.close()


def test_a_stopped_engine_core_gets_engine_stop(ctx: zmq.Context, hub: Hub,
                                                membership: Membership) -> None:
    commands: Receiver[ToEngine] = Receiver(ctx, Codec(ToEngine), "tcp://127.0.0.1:0")
    try:
        replica = form_replica(membership, {"w0": 64})
        engine = replica.engine
        assert engine is not None
        engine.command_address = commands.address
        hub.stop_engine(engine, "worker w0 lost")
        hub.stop_engine(engine, "again")              # asked once
        assert commands.recv(timeout_ms=5000) == EngineStop(reason="worker w0 lost")
        assert commands.recv(timeout_ms=200) is None
    finally:
        commands.close()


def test_front_ends_get_the_state_and_the_statistics(ctx: zmq.Context, hub: Hub,
                                                     membership: Membership) -> None:
    replica = form_replica(membership, {"w0": 64})
    assert replica.engine is not None
    membership.engine_report(report(replica.engine))
    links = [ClusterLink(ctx, hub.query_address, i) for i in range(2)]
    states: list[ClusterState] = []

    async def run() -> None:
        tasks = [asyncio.ensure_future(link.run(lambda i=i: frontend_report(i), states.append))
                 for i, link in enumerate(links)]
        try:
            await until(lambda: len(hub.frontends) == 2 and bool(states))
            stats = await links[0].stats(frontend_report(0, num_live=3))
            assert stats is not None
            assert (stats.num_requests_total, stats.num_migrations) == (30, 1)
            assert [r.replica_id for r in stats.replicas] == [0]
            assert stats.state == membership.cluster_state()
            assert stats.num_parked == 0 and hub.seen_at(0) > 0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        for link in links:
            link.close()
    assert [r.replica_id for r in states[-1].ready] == [0]
    assert hub.seen_at(1) > 0 and hub.seen_at(5) == 0


def test_abort_is_relayed_to_every_other_front_end(ctx: zmq.Context, hub: Hub) -> None:
    links = [ClusterLink(ctx, hub.query_address, i) for i in range(3)]
    asked: dict[int, list[str]] = {i: [] for i in range(3)}
    holds = {1: "held-by-1", 2: "held-by-2"}

    owners: list[str] = []

    def on_abort(index: int) -> Callable[[str, str], bool]:
        def answer(request_id: str, owner: str = "") -> bool:
            asked[index].append(request_id)
            owners.append(owner)
            return holds.get(index) == request_id
        return answer

    for i, link in enumerate(links):
        link.on_abort = on_abort(i)

    async def run() -> None:
        tasks = [asyncio.ensure_future(link.run(lambda i=i: frontend_report(i), lambda s: None))
                 for i, link in enumerate(links)]
        try:
            await until(lambda: len(hub.frontends) == 3)
            assert await links[0].abort_elsewhere("held-by-2")
            assert await links[1].abort_elsewhere("held-by-2")
            assert not await links[0].abort_elsewhere("nobody", owner="ab12")
            assert owners[-2:] == ["ab12", "ab12"]     # the asker's owner (API keys) goes along
            # Never asked its own query.
            assert asked[0] == ["held-by-2"] and asked[1] == ["held-by-2", "nobody"]
            assert asked[2] == ["held-by-2", "held-by-2", "nobody"]
            # A front end that no longer answers: the others' answer comes at the timeout.
            tasks[2].cancel()
            await asyncio.gather(tasks[2], return_exceptions=True)
            start = time.monotonic()
            assert await links[0].abort_elsewhere("held-by-1", timeout_s=5.0)
            assert ABORT_TIMEOUT_S * 0.8 <= time.monotonic() - start < 5.0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        for link in links:
            link.close()
