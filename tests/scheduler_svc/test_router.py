"""The router: prefix-versus-load scoring, parking until a replica is ready or the deadline,
re-routing when a replica went down meanwhile, and migration of a lost replica's requests,
with fake engines (the e2e tests run the real ones)."""

import time

from scheduler_svc.placement import ReplicaState
from scheduler_svc.request import Request, RequestOutput, SamplingParams
from scheduler_svc.router import Router
from services.kv_wire import (
    PrefixReply,
    ReplicaPrefix,
)
from tests.scheduler_svc.fakes import FakeEngine, add_replica


def request(request_id: str, num_tokens: int, deadline: float = 1e12) -> Request:
    r = Request(request_id, list(range(100, 100 + num_tokens)),
                SamplingParams(temperature=0.0, max_tokens=4), (2,), 4096, 16, hash_blocks=True)
    r.deadline = deadline
    return r


def submitted(router: Router, r: Request,
              outputs: list[RequestOutput] | None = None) -> Request:
    """`r` live (as the frontend adds it), then dispatched."""
    router.live.add(r, (outputs if outputs is not None else []).append)
    router.dispatch(r)
    return r


def test_route_prefers_the_cached_prefix_unless_much_busier(router: Router) -> None:
    a, b = FakeEngine(0), FakeEngine(1)
    add_replica(router.membership, a)
    add_replica(router.membership, b)
    load = {0: 3, 1: 0}
    router.live.num_on = load.__getitem__  # type: ignore[method-assign]
    router._cached_blocks = lambda hashes: {0: 20}  # type: ignore[method-assign]
    # 320 cached tokens on replica 0 outweigh 3 more live requests (3 x 64 tokens).
    assert router.route(request("r1", 400)) is a
    load[0] = 6                                       # 6 x 64 > 320: now it is too busy
    assert router.route(request("r2", 400)) is b
    router._cached_blocks = lambda hashes: {}  # type: ignore[method-assign]
    load[0], load[1] = 1, 2                           # nothing cached: least loaded
    assert router.route(request("r3", 400)) is a
    a.kv_ok = False                                   # its pool is being re-created
    assert router.route(request("r4", 400)) is b


def test_store_hits_count_as_cached_on_every_replica(router: Router) -> None:
    """A prefix the KV store holds is reachable from both replicas (a load): it no longer
    pulls the prompt to the replica that computed it, so the less busy replica wins, while
    the replica's own longer device hit still counts in full."""
    a, b = FakeEngine(0), FakeEngine(1)
    add_replica(router.membership, a)
    add_replica(router.membership, b)
    router.live.num_on = {0: 1, 1: 0}.__getitem__  # type: ignore[method-assign]

    class Kv:
        reply = PrefixReply(epoch=1, replicas=[ReplicaPrefix(0, 20, 16), ReplicaPrefix(1, 0, 16)])

        def call(self, message: object, timeout_ms: int) -> PrefixReply:
            return self.reply

        def close(self) -> None:
            pass

    router._route_kv = Kv()  # type: ignore[assignment]
    assert router._cached_blocks([b"x" * 32]) == {0: 20, 1: 16}
    # 320 tokens on replica 0 vs 256 from the store on replica 1: 64 tokens apart, exactly
    # the weight of replica 0's one more live request; the tie goes to the lower id.
    assert router.route(request("r1", 400)) is a
    Kv.reply = PrefixReply(epoch=1, replicas=[ReplicaPrefix(0, 16, 16), ReplicaPrefix(1, 0, 16)])
    assert router.route(request("r2", 400)) is b       # only the store: the idle one


def test_parked_until_a_replica_is_ready_or_the_deadline(router: Router) -> None:
    outputs: list[RequestOutput] = []
    submitted(router, request("late", 8), outputs)
    submitted(router, request("soon", 8, deadline=time.monotonic() - 1), outputs)
    assert router.live.num_parked == 2
    router.live.expire_parked(time.monotonic())
    assert [o.request_id for o in outputs] == ["soon"] and "deadline" in (outputs[0].error or "")
    engine = FakeEngine(0)
    add_replica(router.membership, engine)
    router.dispatch_parked()
    assert engine.submitted == ["late"] and router.live.num_parked == 0
    assert router.live.num_on(0) == 1


def test_dispatch_retries_when_the_engine_went_down_meanwhile(router: Router) -> None:
    dying, healthy = FakeEngine(0), FakeEngine(1)
    dying.accepts = False
    add_replica(router.membership, dying)
    add_replica(router.membership, healthy)

    def down(*_: object) -> None:   # submit refused: the replica is no longer ready
        router.membership.replicas[0].state = ReplicaState.DOWN
        dying.submitted.append("refused")

    dying.submit = lambda r: (down(), False)[1]  # type: ignore[method-assign]
    submitted(router, request("r", 8))
    assert healthy.submitted == ["r"] and dying.submitted == ["refused"]
    assert router.live.num_on(0) == 0 and router.live.num_on(1) == 1




def test_a_lost_replicas_requests_move_to_another(router: Router) -> None:
    dying, healthy = FakeEngine(0), FakeEngine(1)
    add_replica(router.membership, dying)
    r = submitted(router, request("r", 8))
    gone = submitted(router, request("gone", 8))
    assert dying.submitted == ["r", "gone"]
    router.live.remove("gone")                       # its client went away meanwhile
    router.membership.replicas[0].state = ReplicaState.DOWN
    add_replica(router.membership, healthy)
    router.replica_down(dying, [r, gone])            # as membership calls it
    assert healthy.submitted == ["r"] and router.num_migrations == 1
    assert router.live.num_on(0) == 0 and router.live.num_on(1) == 1
