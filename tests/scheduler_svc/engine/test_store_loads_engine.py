"""KV loads from the store as the engine sees them (scheduler_svc/engine.py with
scheduler_svc/store_loads.py): a real ReplicaEngine over the fake transport of test_engine.py,
with a fake two-rank worker that answers a step that loads with every rank's KvLoaded (rank 1's
can be held back). Checks that a loading request waits for every rank's report while other
requests run, and that a short load recomputes the rest with the right outputs. The
scheduler-level tests of the same loads are in test_store_loads.py."""

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from scheduler_svc.engine.config import EngineConfig, SchedulerConfig
from scheduler_svc.engine.core import ReplicaEngine
from scheduler_svc.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from services.wire import (
    CacheReady,
    FromWorker,
    InitCache,
    KvLoaded,
    StepInput,
    StepOutput,
    ToWorker,
    WorkerFailure,
)
from tests.scheduler_svc.engine import engine_harness
from tests.scheduler_svc.engine.engine_harness import (
    EOS,
    MAX_MODEL_LEN,
    FakeTransport,
    FakeWorker,
    RecordingHost,
    expected_tokens,
    final,
    wait_until,
)
from tests.scheduler_svc.engine.test_store_loads import SLICES, put_chunks

E_BLOCK = engine_harness.BLOCK_SIZE      # 4
E_CHUNK = 16
E_PROMPT = list(range(10, 50))         # 40 tokens: 2 whole chunks (32 tokens) in the store


class LoadingWorker(FakeWorker):
    """FakeWorker as two tensor-parallel ranks: every rank answers InitCache, rank 0 answers
    the step, and each rank answers a step that loads with its own KvLoaded (`per_rank`: what
    each rank reports loaded, capped at what was asked). Loading itself is a no-op: the fake
    model's tokens do not depend on the KV."""

    def __init__(self, per_rank: tuple[int, int]) -> None:
        super().__init__()
        self.per_rank = per_rank
        self.load_steps: list[int] = []

    def _step(self, step: StepInput) -> StepOutput | WorkerFailure:
        """A layer-wise load (one that also computes) as the runner settles it: the ranks
        agree on the smallest count; a short one samples nothing and rolls back."""
        out = super()._step(step)
        agreed = min(self.per_rank)
        for r in step.new_requests:
            if not (r.num_load_tokens and r.num_new_tokens and agreed < r.num_load_tokens):
                continue
            assert self.batch is not None and isinstance(out, StepOutput)
            state = self.batch.requests[r.request_id]
            i = out.request_ids.index(r.request_id)
            del out.request_ids[i], out.sampled_token_ids[i], out.logprobs[i]
            state.token_ids.pop()
            state.num_computed_tokens = r.num_computed_tokens + agreed
        return out

    def answer_all(self, message: ToWorker) -> list[FromWorker]:
        if isinstance(message, InitCache):
            self.answer(message)
            return [CacheReady(worker_id=f"rank-{rank}", num_blocks=message.num_blocks)
                    for rank in range(2)]
        assert isinstance(message, StepInput)
        loads = {r.request_id: r.num_load_tokens for r in message.new_requests
                 if r.num_load_tokens}
        layerwise = any(r.num_new_tokens for r in message.new_requests if r.num_load_tokens)
        out = self.answer(message)
        if not loads:
            return [out]
        self.load_steps.append(message.step_id)
        # Layer-wise loads: every rank reports the count the ranks agreed on.
        per_rank = [min(self.per_rank)] * 2 if layerwise else self.per_rank
        reports = [KvLoaded(f"rank-{rank}", message.step_id, list(loads),
                            [min(num, per_rank[rank]) for num in loads.values()])
                   for rank in range(2)]
        return [reports[0], out, reports[1]]      # the output between the two ranks' reports


class LoadingTransport(FakeTransport):
    """FakeTransport for two ranks; rank 1's KvLoaded is held back while `release` is clear."""

    num_ranks = 2

    def __init__(self, worker: LoadingWorker) -> None:
        super().__init__(worker)
        self.loading_worker = worker
        self.replies: deque[FromWorker] = deque()
        self.release = threading.Event()
        self.release.set()

    def recv_from_ranks(self, timeout_ms: int) -> FromWorker | None:
        message = self._next_ready()
        if message is None and self._sent and self.worker.gate.is_set():
            time.sleep(engine_harness.STEP_S)
            self.replies.extend(self.loading_worker.answer_all(self._sent.popleft()))
            message = self._next_ready()
        if message is None:
            time.sleep(min(timeout_ms, 5) / 1000)
        return message

    def _next_ready(self) -> FromWorker | None:
        """The oldest reply not held back (rank 1's reports wait for `release`)."""
        for i, message in enumerate(self.replies):
            if (isinstance(message, KvLoaded) and message.worker_id == "rank-1"
                    and not self.release.is_set()):
                continue
            del self.replies[i]
            return message
        return None

    def num_unanswered_steps(self) -> int:
        return sum(isinstance(m, StepInput) for m in self._sent)


class LoadingReplica:
    def __init__(self, engine: ReplicaEngine, host: RecordingHost, transport: LoadingTransport,
                 worker: LoadingWorker) -> None:
        self.engine, self.host, self.transport, self.worker = engine, host, transport, worker

    def submit(self, request_id: str, prompt: list[int], max_tokens: int,
               ) -> "queue.SimpleQueue[RequestOutput]":
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (EOS,),
                          MAX_MODEL_LEN, E_BLOCK, hash_blocks=True, handle=len(self.host.ids))
        self.host.ids.append(request_id)
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.host.queues[request_id] = outputs
        assert self.engine.submit(request)
        return outputs


@contextmanager
def loading_replica(per_rank: tuple[int, int], layerwise: bool = False
                    ) -> Iterator[LoadingReplica]:
    worker = LoadingWorker(per_rank)
    transport = LoadingTransport(worker)
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=E_CHUNK)
    put_chunks(store, E_PROMPT, E_BLOCK, 2)
    assert transport.pools is not None
    transport.pools.store = store
    host = RecordingHost()
    config = EngineConfig(
        replica_id=0, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                block_size=E_BLOCK,
                                                max_model_len=MAX_MODEL_LEN,
                                                layerwise_loads=layerwise),
        num_kv_blocks=64, kv_timeout_s=2.0, step_timeout_s=10.0, ship_sampled_tokens=False,
        store_slices=SLICES)
    engine = ReplicaEngine(config, lambda: transport, host)
    engine.start()
    try:
        assert engine.ready.wait(10), "the engine did not come up"
        yield LoadingReplica(engine, host, transport, worker)
    finally:
        transport.release.set()
        worker.gate.set()
        engine.stop()
    assert transport.closed and host.downs == []


def test_a_load_waits_for_every_ranks_report_while_other_requests_run() -> None:
    """The load's step is done when its output is in, but the loading request waits for every
    rank's KvLoaded; meanwhile other requests run (their outputs do not wait for the load)."""
    with loading_replica((32, 32)) as r:
        r.transport.release.clear()                  # rank 1's KvLoaded does not come yet
        outputs = r.submit("a", E_PROMPT, max_tokens=4)
        assert wait_until(lambda: r.worker.load_steps)
        time.sleep(0.3)
        # Rank 0's report and the step's output are in; "a" goes on only with rank 1's.
        assert r.worker.num_steps == 1 and r.transport.num_unanswered_steps() == 0
        assert wait_until(lambda: r.engine.stats().num_steps == 1) and outputs.empty()
        other = [7, 8, 9, 11, 12]                    # too short for a chunk: no load
        tokens, last = final(r.submit("b", other, max_tokens=3))
        assert last.error is None and tokens == expected_tokens(other, 3)
        assert outputs.empty() and r.engine.stats().num_store_loaded_tokens == 0
        r.transport.release.set()
        tokens, last = final(outputs)
        assert last.error is None and tokens == expected_tokens(E_PROMPT, 4)
        assert last.num_cached_tokens == 32
        assert wait_until(lambda: r.engine.stats().num_store_loaded_tokens == 32)
        stats = r.engine.stats()
        assert (stats.num_store_hit_tokens, stats.num_store_miss_tokens,
                stats.num_store_load_fallbacks) == (32, 8 + len(other), 0)


@pytest.mark.parametrize("per_rank, num_loaded", [((32, 16), 16), ((0, 32), 0),
                                                  ((32, 32), 32)],
                         ids=["rank-1-short", "rank-0-nothing", "full"])
def test_a_short_load_recomputes_and_the_outputs_are_right(per_rank: tuple[int, int],
                                                           num_loaded: int) -> None:
    with loading_replica(per_rank) as r:
        tokens, last = final(r.submit("a", E_PROMPT, max_tokens=6))
        assert last.error is None and last.finish_reason is FinishReason.LENGTH
        assert tokens == expected_tokens(E_PROMPT, 6)
        assert last.num_cached_tokens == num_loaded
        assert len(r.worker.load_steps) == 1
        assert wait_until(lambda: r.engine.stats().num_store_loaded_tokens == num_loaded)
        assert r.engine.stats().num_store_load_fallbacks == (num_loaded < 32)
        # The step after the load committed every full block: the same prompt now hits the
        # device's prefix cache (all but the last token's block) and loads nothing.
        tokens, last = final(r.submit("b", E_PROMPT, max_tokens=2))
        assert tokens == expected_tokens(E_PROMPT, 2) and last.num_cached_tokens == 36
        assert len(r.worker.load_steps) == 1
        assert r.worker.batch is not None and not r.worker.batch.discarded_ids


@pytest.mark.parametrize("per_rank, num_loaded", [((32, 32), 32), ((32, 16), 16)],
                         ids=["full", "rank-1-short"])
def test_a_layerwise_load_samples_in_its_own_step(per_rank: tuple[int, int],
                                                  num_loaded: int) -> None:
    """The load's step computes the rest of the prompt: a full load's first token comes from
    it (one step fewer than a background load); a short one's step samples nothing, and the
    request is computed on from what every rank loaded. Outputs are right either way, with
    rank 1's report held back past the step's output."""
    with loading_replica(per_rank, layerwise=True) as r:
        r.transport.release.clear()
        outputs = r.submit("a", E_PROMPT, max_tokens=6)
        assert wait_until(lambda: r.worker.load_steps)
        time.sleep(0.2)
        assert r.worker.num_steps == 1
        if num_loaded == 32:
            first = outputs.get(timeout=5)             # before rank 1 reported
            assert first.new_token_ids == expected_tokens(E_PROMPT, 1)
        else:
            assert outputs.empty()
        r.transport.release.set()
        tokens, last = final(outputs)
        if num_loaded == 32:
            tokens = expected_tokens(E_PROMPT, 1) + tokens
        assert last.error is None and tokens == expected_tokens(E_PROMPT, 6)
        assert last.num_cached_tokens == num_loaded
        assert r.worker.num_steps == 6 + (num_loaded < 32)
        assert wait_until(lambda: r.engine.stats().num_store_loaded_tokens == num_loaded)
        assert r.engine.stats().num_store_load_fallbacks == (num_loaded < 32)
