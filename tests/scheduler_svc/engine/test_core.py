"""ReplicaEngine's step loop driven through a fake transport: kvcache_svc's real pools
in-process and a fake one-rank worker; no model, no sockets, no processes. Covers what only
the loop shows: an idle replica sends nothing; the batch queue keeps two steps in flight
(pipeline parallel and async scheduling); kvcache_svc lost or restarted costs recompute and
no request; a step the worker fails ends just its requests, a rank that reports a lost peer
takes the replica down with no request failed (their front ends move them); a request
longer than the pool is refused; a restarted front end's requests are dropped."""

import queue
import time
from typing import Any

import pytest

from kvcache_svc.pools import KvCachePools
from scheduler_svc.engine.request import FinishReason, RequestOutput
from scheduler_svc.engine.wire import FrontendHello
from tests.scheduler_svc.engine.engine_harness import (
    Replica,
    expected_tokens,
    final,
    first_output,
    replica,
    wait_until,
)


def test_idle_replica_sends_nothing() -> None:
    with replica() as r:
        tokens, last = final(r.submit("a", list(range(10, 20)), max_tokens=3))
        assert tokens == expected_tokens(list(range(10, 20)), 3)
        time.sleep(0.2)                  # the plan that frees a's blocks
        assert r.num_used_blocks() == 0
        assert r.transport.pools is not None
        _, num_plans = r.transport.pools.stats()
        num_steps = r.worker.num_steps
        time.sleep(0.5)
        # Before: an empty plan every ~2 ms (a's finished id waiting for a step to carry it).
        assert r.transport.pools.stats()[1] == num_plans
        assert r.worker.num_steps == num_steps
        # The worker drops a's state with the next step.
        assert r.worker.batch is not None and "a" in r.worker.batch.requests
        final(r.submit("b", [1, 2, 3], max_tokens=1))
        assert set(r.worker.batch.requests) == {"b"}


@pytest.mark.parametrize("depth", [
    {"max_batches_in_flight": 2},          # pp=2: a step per stage
    {"async_scheduling": True},            # pp=1: plan step N+1 while step N runs
], ids=["pp-batch-queue", "async-scheduling"])
def test_two_steps_in_flight_give_the_tokens_of_one(depth: dict[str, Any]) -> None:
    with replica(**depth) as r:
        streams = {f"r{i}": r.submit(f"r{i}", list(range(10 + i, 20 + i)), max_tokens=12)
                   for i in range(4)}
        for i, (request_id, outputs) in enumerate(streams.items()):
            tokens, last = final(outputs)
            assert last.error is None, request_id
            assert tokens == expected_tokens(list(range(10 + i, 20 + i)), 12), request_id
        assert r.transport.max_steps_in_flight == 2


def test_one_step_in_flight_by_default_and_the_stats_snapshot() -> None:
    with replica() as r:
        before = r.engine.stats()
        assert before.num_steps == 0 and before.num_free_blocks == before.num_usable_blocks == 63
        outputs = r.submit("a", list(range(10, 20)), max_tokens=6)
        first_output(outputs)
        r.worker.gate.clear()
        assert wait_until(lambda: r.engine.stats().num_running == 1)
        during = r.engine.stats()
        assert during.num_free_blocks < 63 and during.num_prompt_tokens_admitted == 10
        r.worker.gate.set()
        final(outputs)
        assert r.transport.max_steps_in_flight == 1
        assert wait_until(lambda: r.engine.stats().num_free_blocks == 63)
        after = r.engine.stats()
        assert after.num_running == after.num_waiting == 0 and after.num_steps >= 6
        assert before.num_steps == 0     # a snapshot never changes once taken


def test_kvcache_lost_then_restarted_costs_recompute_not_requests() -> None:
    with replica() as r:
        running = r.submit("a", list(range(10, 19)), max_tokens=40)
        streamed = first_output(running).new_token_ids
        r.transport.pools = None         # kvcache_svc stops answering
        assert wait_until(lambda: not r.engine.kv_ok)
        waiting = r.submit("b", list(range(30, 39)), max_tokens=5)
        time.sleep(0.1)
        assert waiting.empty()           # nothing is admitted meanwhile
        r.transport.pools = KvCachePools(epoch=2)   # back, as a new instance without our pool
        tokens, last = final(running)
        assert last.error is None
        assert streamed + tokens == expected_tokens(list(range(10, 19)), 40)
        tokens, last = final(waiting)
        assert last.error is None and tokens == expected_tokens(list(range(30, 39)), 5)
        assert r.engine.kv_ok and r.engine.num_kv_recoveries == 1 and r.downs == []


def test_failed_step_fails_its_requests_and_the_replica_serves_on() -> None:
    with replica(max_num_seqs=2) as r:
        running = r.submit("ok-1", list(range(10, 19)), max_tokens=60)
        first_output(running)
        r.worker.gate.clear()            # ok-1 has many tokens to go: it is still running
        # bad joins ok-1's next step; ok-2 waits for a slot (max_num_seqs).
        bad = r.submit("bad", list(range(30, 39)), max_tokens=5)
        later = r.submit("ok-2", list(range(50, 59)), max_tokens=5)
        r.worker.gate.set()
        for outputs in (running, bad):
            _, last = final(outputs)
            assert last.finish_reason is FinishReason.ABORT
            assert last.error is not None and "injected fault" in last.error
        tokens, last = final(later)
        assert last.error is None and last.finish_reason is FinishReason.LENGTH
        assert tokens == expected_tokens(list(range(50, 59)), 5)
        assert r.downs == [] and r.engine.num_kv_recoveries == 0
        time.sleep(0.2)
        assert r.num_used_blocks() == 0
        # The worker forgot the failed ones once their finished ids came.
        assert r.worker.batch is not None and not r.worker.batch.discarded_ids
        # A failure after the forward wrote its KV leaves the prefix index as it is: the
        # same prompt hits the blocks bad committed.
        _, last = final(r.submit("ok-3", list(range(30, 39)), max_tokens=1))
        assert last.num_cached_tokens == 8


def test_failed_step_without_its_kv_empties_the_prefix_index() -> None:
    # Two batches in flight keep ok-1 and bad in different steps.
    with replica(max_batches_in_flight=2) as r:
        r.worker.kv_written = False
        running = r.submit("ok-1", list(range(10, 19)), max_tokens=40)
        streamed = first_output(running).new_token_ids
        r.worker.gate.clear()
        bad = r.submit("bad", list(range(30, 39)), max_tokens=5)
        r.worker.gate.set()
        _, last = final(bad)
        assert last.error is not None and "injected fault" in last.error
        # ok-1 was not in bad's step: it recomputes (the pool is re-created) and finishes.
        tokens, last = final(running)
        assert last.error is None
        assert streamed + tokens == expected_tokens(list(range(10, 19)), 40)
        assert r.downs == [] and r.engine.num_kv_recoveries == 1
        # bad's blocks were indexed when planned but never written: nothing may hit them.
        _, last = final(r.submit("ok-2", list(range(30, 39)), max_tokens=1))
        assert last.num_cached_tokens == 0


Outputs = queue.SimpleQueue[RequestOutput]


def two_in_one_step(r: Replica, first: str, second: str) -> tuple[Outputs, Outputs]:
    """`first` decoding, then `second` joins its next step."""
    running = r.submit(first, list(range(10, 19)), max_tokens=60)
    first_output(running)
    r.worker.gate.clear()
    joining = r.submit(second, list(range(30, 39)), max_tokens=5)
    r.worker.gate.set()
    return running, joining


def test_a_rank_that_failed_the_step_fails_its_requests_and_the_replica_goes_down() -> None:
    with replica() as r:
        running, failing = two_in_one_step(r, "ok-1", "rank-1")
        _, last = final(failing)
        assert last.finish_reason is FinishReason.ABORT and last.server_fault
        assert last.error is not None and "rank fault" in last.error
        assert wait_until(lambda: r.downs)
        # ok-1 shared the failed step: its request failed too, before the engine went down.
        _, last = final(running)
        assert last.error is not None and "rank fault" in last.error
        assert not r.host.queues


def test_a_lost_peer_takes_the_replica_down_and_fails_no_request() -> None:
    # Before: the survivor of a killed pipeline stage reported its broken send as a step
    # failure, and the step's requests ended INTERNAL instead of moving to another replica.
    with replica() as r:
        running, joining = two_in_one_step(r, "ok-1", "peer-1")
        assert wait_until(lambda: r.downs)
        assert "peer fault" in r.downs[0]
        # No error, no final output: their front ends hear the engine went down and move them.
        assert sorted(r.host.queues) == ["ok-1", "peer-1"]
        while not running.empty():
            assert running.get().finish_reason is None
        assert joining.empty()


def test_a_restarted_front_end_s_requests_are_dropped() -> None:
    with replica() as r:
        r.engine.hello(FrontendHello(frontend=1, epoch=10, output_address="tcp://x:1"))
        old = r.submit("old", list(range(10, 19)), max_tokens=200, frontend=1)
        other = r.submit("other", list(range(30, 39)), max_tokens=60, frontend=0)
        first_output(old)
        # Front end 1 restarted: its earlier incarnation's clients are gone.
        r.engine.hello(FrontendHello(frontend=1, epoch=11, output_address="tcp://x:2"))
        _, last = final(old)
        assert last.finish_reason is FinishReason.ABORT
        tokens, last = final(other)
        assert last.finish_reason is FinishReason.LENGTH and len(tokens) >= 59


def test_a_request_longer_than_the_pool_is_refused_and_the_replica_serves_on() -> None:
    # 63 usable blocks of 4 tokens: 252 tokens. Before, this request was admitted, grew to
    # fill the pool, preempted itself, and then waited forever.
    with replica() as r:
        _, last = final(r.submit("long", list(range(10, 250)), max_tokens=15))
        assert last.finish_reason is FinishReason.ABORT and last.invalid
        assert last.error is not None and "pool holds 252 tokens" in last.error
        tokens, last = final(r.submit("short", list(range(10, 20)), max_tokens=3))
        assert last.error is None and tokens == expected_tokens(list(range(10, 20)), 3)
        assert not r.host.queues and r.downs == []
