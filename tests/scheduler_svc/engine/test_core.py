"""ReplicaEngine's step loop driven through a fake transport: kvcache_svc's real pools
in-process and a fake one-rank worker; no model, no sockets, no processes. Covers what only
the loop shows: an idle replica sends nothing; the batch queue keeps two steps in flight
(pipeline parallel and async scheduling); kvcache_svc lost or restarted costs recompute and
no request; a step the worker fails ends just its requests, a rank that reports a lost peer
takes the replica down with no request failed (their front ends move them); a request
longer than the pool is refused; a restarted front end's requests are dropped."""

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvcache_svc.pools import KvCachePools
from scheduler_svc.engine.config import EngineConfig, SchedulerConfig
from scheduler_svc.engine.core import ReplicaEngine
from scheduler_svc.engine.outputs import StepPacker
from scheduler_svc.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from scheduler_svc.engine.wire import EngineStats, FrontendHello
from services.kv_wire import (
    FromKvCache,
    ToKvCache,
)
from services.wire import (
    CacheReady,
    FromWorker,
    InitCache,
    StepError,
    StepInput,
    StepOutput,
    StepTimings,
    ToWorker,
    WorkerFailure,
)
from worker_svc.input_batch import InputBatch

EOS = 2
BLOCK_SIZE = 4
MAX_MODEL_LEN = 256
STEP_S = 0.002     # the fake forward: long enough for a test to close the gate mid-stream


def token_at(position: int) -> int:
    """The fake model's next token after `position` tokens: recompute gives the same."""
    return 3 + position % 50


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [token_at(len(prompt) + i) for i in range(max_tokens)]


class FakeWorker:
    """A one-rank worker: InputBatch for its state, `token_at` for a model, and the runner's
    failure contract: a step holding a request id starting with "bad" fails, the batch
    discards the step, and the answer is a StepOutput with the error. A request id starting
    with "rank" or "peer" makes it answer as a rank of a bigger replica would: WorkerFailure,
    the step failed here or a collective with a lost peer failed."""

    def __init__(self) -> None:
        self.kv_written = True           # what a failed step reports
        self.gate = threading.Event()    # cleared: steps wait (the test arranges a batch)
        self.gate.set()
        self.batch: InputBatch | None = None
        self.num_steps = 0

    def answer(self, message: ToWorker) -> FromWorker:
        if isinstance(message, InitCache):
            self.batch = InputBatch(message.num_blocks, message.block_size, 1000, MAX_MODEL_LEN)
            return CacheReady(worker_id="fake", num_blocks=message.num_blocks)
        self.num_steps += 1
        return self._step(message)

    def _step(self, step: StepInput) -> StepOutput | WorkerFailure:
        assert self.batch is not None
        timings = StepTimings(0.0, 0.0, 0.0, 0)
        try:
            scheduled = self.batch.apply(step)
            ids = [s.state.request_id for s in scheduled]
            for prefix, peer_lost in (("rank", False), ("peer", True)):
                if any(i.startswith(prefix) for i in ids):
                    return WorkerFailure(worker_id="fake", step_id=step.step_id,
                                         message=f"{prefix} fault", peer_lost=peer_lost)
            if any(i.startswith("bad") for i in ids):
                raise RuntimeError("injected fault")
        except Exception as exc:
            self.batch.discard(step)
            return StepOutput(step.step_id, "fake", [], [], [], timings,
                              StepError(f"{type(exc).__name__}: {exc}", self.kv_written))
        ids, tokens = [], []
        rows = [-1] * (len(step.decodes.slots) // 4 if step.decodes is not None else 0)
        for s in scheduled:
            if s.samples:
                token = token_at(len(s.state.token_ids))
                s.state.token_ids.append(token)
                if s.decode_row >= 0:      # a compact decode row (services.wire.DecodeRows)
                    rows[s.decode_row] = token
                else:
                    tokens.append(token)
                    ids.append(s.state.request_id)
        return StepOutput(step.step_id, "fake", ids, tokens, [None] * len(ids), timings,
                          decode_token_ids=np.asarray(rows, dtype="<i4").tobytes())


class FakeTransport:
    """The engine's transport without sockets: kvcache_svc's real pools in-process (`pools`;
    None: kvcache_svc does not answer) and the fake worker, which answers a message when the
    engine waits for it (and its gate is open)."""

    num_ranks = 1

    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.pools: KvCachePools | None = KvCachePools(epoch=1)
        self._sent: deque[ToWorker] = deque()
        self.max_steps_in_flight = 0     # steps sent before the oldest was answered
        self.closed = False

    def call_kv(self, message: ToKvCache, timeout_ms: int) -> FromKvCache | None:
        pools = self.pools
        if pools is None:
            time.sleep(min(timeout_ms, 20) / 1000)
            return None
        return pools.handle(message)

    def send_to_ranks(self, message: ToWorker) -> None:
        self._sent.append(message)
        self.max_steps_in_flight = max(self.max_steps_in_flight,
                                       sum(isinstance(m, StepInput) for m in self._sent))

    def recv_from_ranks(self, timeout_ms: int) -> FromWorker | None:
        if not self._sent or not self.worker.gate.is_set():
            time.sleep(min(timeout_ms, 5) / 1000)
            return None
        time.sleep(STEP_S)
        return self.worker.answer(self._sent.popleft())

    def close(self) -> None:
        self.closed = True


class RecordingHost:
    """The engine's host as a test sees it: each request's outputs on a queue of its own,
    the front ends' hellos, and the reasons the engine went down."""

    def __init__(self) -> None:
        self.queues: dict[str, queue.SimpleQueue[RequestOutput]] = {}
        self.downs: list[str] = []
        self.hellos: dict[int, int] = {}      # front end -> its epoch
        self.num_ready = 0
        self.ids: list[str] = []              # request ids by handle

    def outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self.queues.get(out.request_id)
            if q is not None:
                q.put(out)
                if out.finish_reason is not None:
                    del self.queues[out.request_id]

    def packed(self, packer: StepPacker) -> None:
        """A step's packed outputs, back as one RequestOutput per request (handles are the
        requests' submission order here)."""
        for p in packer.packers.values():
            finished = {f.handle: f for f in p.finished}
            tokens: dict[int, list[int]] = {}
            for handle, token_id in zip(p.handles, p.token_ids, strict=True):
                tokens.setdefault(handle, []).append(token_id)
            for handle in tokens.keys() | finished.keys():
                f = finished.get(handle)
                ids = tokens.get(handle, [])
                out = RequestOutput(self.ids[handle], ids, [None] * len(ids))
                if f is not None:
                    out.finish_reason = FinishReason(f.reason)
                    out.stop_reason = f.stop_token_id
                    out.num_cached_tokens = f.num_cached_tokens
                    out.num_output_tokens = f.num_output_tokens
                    out.error, out.server_fault, out.invalid = f.error, f.server_fault, f.invalid
                self.outputs([out])

    def hello(self, hello: FrontendHello) -> bool:
        old = self.hellos.get(hello.frontend)
        self.hellos[hello.frontend] = hello.epoch
        return old is not None and old != hello.epoch

    def ready(self) -> None:
        self.num_ready += 1

    def stats(self, stats: EngineStats, idle: bool) -> None:
        pass

    def kv_changed(self, kv_ok: bool) -> None:
        pass

    def down(self, reason: str) -> None:
        self.downs.append(reason)


@dataclass
class Replica:
    engine: ReplicaEngine
    host: RecordingHost
    transport: FakeTransport
    worker: FakeWorker

    @property
    def downs(self) -> list[str]:
        return self.host.downs

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, frontend: int = 0,
               ) -> "queue.SimpleQueue[RequestOutput]":
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (EOS,),
                          MAX_MODEL_LEN, BLOCK_SIZE, hash_blocks=True, frontend=frontend,
                          handle=len(self.host.ids))
        self.host.ids.append(request_id)
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.host.queues[request_id] = outputs
        assert self.engine.submit(request)
        return outputs

    def num_used_blocks(self) -> int:
        assert self.transport.pools is not None
        pools, _ = self.transport.pools.stats()
        return pools[0].num_used_blocks


def first_output(outputs: "queue.SimpleQueue[RequestOutput]") -> RequestOutput:
    return outputs.get(timeout=10)


def final(outputs: "queue.SimpleQueue[RequestOutput]") -> tuple[list[int], RequestOutput]:
    """Every token streamed, and the last output."""
    tokens: list[int] = []
    while True:
        out = outputs.get(timeout=10)
        tokens += out.new_token_ids
        if out.finish_reason is not None:
            return tokens, out


@contextmanager
def replica(max_num_seqs: int = 8, max_batches_in_flight: int = 1,
            async_scheduling: bool = False) -> Iterator[Replica]:
    worker = FakeWorker()
    transport = FakeTransport(worker)
    host = RecordingHost()
    config = EngineConfig(
        replica_id=0, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                max_num_batched_tokens=64,
                                                block_size=BLOCK_SIZE,
                                                max_model_len=MAX_MODEL_LEN),
        num_kv_blocks=64, kv_timeout_s=2.0, step_timeout_s=10.0,
        ship_sampled_tokens=max_batches_in_flight > 1,
        max_batches_in_flight=max_batches_in_flight, async_scheduling=async_scheduling)
    engine = ReplicaEngine(config, lambda: transport, host)
    engine.start()
    try:
        assert engine.ready.wait(10), "the engine did not come up"
        assert host.num_ready == 1
        yield Replica(engine, host, transport, worker)
    finally:
        worker.gate.set()
        engine.stop()
    assert transport.closed


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


def wait_until(condition: "Callable[[], object]", timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


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
