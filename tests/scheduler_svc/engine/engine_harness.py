"""The engine loop's test harness (tests/scheduler_svc/engine/test_core.py and
test_store_loads_engine.py): a fake one-rank worker over the real InputBatch (`FakeWorker`:
its tokens are `token_at`, a request id can make it fail a step), a transport with
kvcache_svc's real pools in-process (`FakeTransport`), a host that records what the engine
says (`RecordingHost`), and a running `ReplicaEngine` over them (`replica`)."""

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

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


def wait_until(condition: "Callable[[], object]", timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
