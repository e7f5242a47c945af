"""KV loads from the store as the scheduler and the engine see them (scheduler_svc/
store_loads.py). Scheduler level: plans go to kvcache_svc's real block manager over a StoreView
of a real in-memory KvStore; the ranks' KvLoaded reports are hand-made. Engine level: the
fake transport of test_engine.py, with a fake two-rank worker that answers a step that loads
with every rank's KvLoaded."""

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvcache_svc.block_manager import ReplicaBlockManager
from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from kvcache_svc.kv_store.view import StoreView
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import EngineConfig, ReplicaEngine
from scheduler_svc.live_requests import LiveRequests
from scheduler_svc.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from scheduler_svc.scheduler import Scheduler
from services.block_hash import hash_full_blocks
from services.kv_chunks import chunk_keys, make_chunk
from services.kv_store_wire import KvSlice
from services.wire import (
    CacheReady,
    FromWorker,
    InitCache,
    KvLoaded,
    StepError,
    StepInput,
    StepOutput,
    StepTimings,
    ToWorker,
)
from tests.scheduler_svc import test_engine as engine_tests
from tests.scheduler_svc.test_engine import (
    EOS,
    MAX_MODEL_LEN,
    FakeTransport,
    FakeWorker,
    expected_tokens,
    final,
    wait_until,
)

SLICES = (KvSlice("tiny", "float16", 0, 2, 0, 2), KvSlice("tiny", "float16", 0, 2, 2, 3))


def put_chunks(store: KvStore, token_ids: list[int], block_size: int, num_chunks: int,
               slices: tuple[KvSlice, ...] = SLICES) -> None:
    """Stores the first `num_chunks` chunks of `token_ids` for every slice (stand-in data)."""
    hashes = hash_full_blocks(token_ids, block_size)
    for kv_slice in slices:
        for key in chunk_keys(hashes, block_size, store.chunk_tokens, kv_slice)[:num_chunks]:
            chunk = make_chunk(key, (4,), bytes(8))
            store.put(chunk.header, chunk.data)


# --------------------------------------------------------------------------- scheduler level

BLOCK_SIZE = 16
CHUNK_TOKENS = 256
PROMPT = [3 + 7 * i % 991 for i in range(600)]   # 2 whole chunks, 37 full blocks
NUM_BLOCKS = 129


def new_kv(store: KvStore) -> ReplicaBlockManager:
    return ReplicaBlockManager(NUM_BLOCKS, BLOCK_SIZE, True,
                               store=StoreView(store, SLICES, BLOCK_SIZE))


def make_request(request_id: str = "a", prompt: list[int] = PROMPT,
                 max_tokens: int = 3) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (EOS,), 4096,
                   BLOCK_SIZE, hash_blocks=True)


def with_store(num_chunks: int = 2, add: bool = True,
               ) -> tuple[Scheduler, ReplicaBlockManager, Request]:
    """A scheduler, its pool over a store holding PROMPT's first chunks, and request "a" of
    PROMPT (queued unless `add` is False)."""
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)
    put_chunks(store, PROMPT, BLOCK_SIZE, num_chunks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                      block_size=BLOCK_SIZE, max_model_len=4096))
    sched.set_capacity(NUM_BLOCKS)
    request = make_request()
    if add:
        sched.add_request(request)
    return sched, new_kv(store), request


def run_step(sched: Scheduler, kv: ReplicaBlockManager) -> StepInput:
    step = sched.apply_plan(kv.apply(sched.schedule()))
    assert step is not None
    return step


def output(step: StepInput, tokens: dict[str, int] | None = None) -> StepOutput:
    tokens = tokens or {}
    return StepOutput(step.step_id, "rank-0", list(tokens), list(tokens.values()),
                      [None] * len(tokens), StepTimings(0.0, 0.0, 0.0, 0))


def loaded(step: StepInput, *per_rank: int, request_id: str = "a") -> list[KvLoaded]:
    return [KvLoaded(f"rank-{rank}", step.step_id, [request_id], [num])
            for rank, num in enumerate(per_rank)]


def test_a_load_is_scheduled_with_nothing_to_compute_and_no_sampling() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    assert not step.running
    [new] = step.new_requests
    assert (new.num_computed_tokens, new.num_new_tokens, new.num_load_tokens) == (0, 0, 512)
    assert len(new.block_ids[0]) == 512 // BLOCK_SIZE and new.token_ids == PROMPT
    # In flight twice: its step, and its load until every rank reported it.
    assert (request.num_computed_tokens, request.num_in_flight, request.num_pending_tokens) == (
        0, 2, 0)
    assert request.num_committed_blocks == 0
    assert step.step_id in sched.loads.steps
    assert (sched.loads.num_hit_tokens, sched.loads.num_miss_tokens) == (512, 88)
    assert (sched.num_prompt_tokens_admitted, sched.num_cached_tokens_admitted) == (600, 0)
    # A token for it is not expected: a worker that sent one anyway is ignored.
    assert sched.update(output(step, {"a": 9})) == []
    assert request.token_ids == PROMPT


@pytest.mark.parametrize("per_rank, resume", [((512, 512), 512), ((512, 256), 256),
                                              ((256, 512), 256), ((0, 512), 0),
                                              ((700, 600), 512)],
                         ids=["full", "rank-1-short", "rank-0-short", "rank-0-none",
                              "over-reported-capped"])
def test_the_request_resumes_after_what_every_rank_loaded(per_rank: tuple[int, int],
                                                          resume: int) -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    assert sched.update(output(step)) == []
    sched.loads.finish(step.step_id, loaded(step, *per_rank), sched.requests)
    assert step.step_id not in sched.loads.steps
    assert request.num_computed_tokens == resume
    assert request.num_cached_tokens == resume
    assert sched.loads.num_loaded_tokens == resume
    assert sched.loads.num_fallbacks == (resume < 512)

    # The next step computes the rest from there and commits every full block.
    step = run_step(sched, kv)
    [running] = step.running
    assert (running.num_computed_tokens, running.num_new_tokens) == (resume, 600 - resume)
    assert len(running.new_block_ids[0]) == -(-600 // BLOCK_SIZE) - 512 // BLOCK_SIZE
    assert kv.requests["a"].num_committed_blocks == request.num_committed_blocks == 37
    [out] = sched.update(output(step, {"a": 11}))
    assert out.new_token_ids == [11]
    step = run_step(sched, kv)
    sched.update(output(step, {"a": 12}))
    step = run_step(sched, kv)
    [last] = sched.update(output(step, {"a": 13}))
    assert last.finish_reason is FinishReason.LENGTH
    assert last.num_cached_tokens == resume


@pytest.mark.parametrize("reports", ["none", "other-request", "one-rank-silent"])
def test_a_rank_that_does_not_name_the_request_loaded_nothing(reports: str) -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    sched.update(output(step))
    given = {"none": [],
             "other-request": [loaded(step, 512)[0], KvLoaded("rank-1", step.step_id, ["x"],
                                                              [512])],
             "one-rank-silent": [loaded(step, 512)[0], KvLoaded("rank-1", step.step_id, [],
                                                                [])]}[reports]
    sched.loads.finish(step.step_id, given, sched.requests)
    assert request.num_computed_tokens == 0
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (0, 1)
    [running] = run_step(sched, kv).running
    assert (running.num_computed_tokens, running.num_new_tokens) == (0, 600)


def test_a_request_aborted_while_loading_is_left_alone() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    final_output = sched.abort("a")
    assert final_output is not None and final_output.finish_reason is FinishReason.ABORT
    # The same id comes back as a new request before the load's reports do.
    again = make_request()
    sched.add_request(again)
    sched.update(output(step))
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.status is RequestStatus.FINISHED and request.num_computed_tokens == 0
    assert again.status is RequestStatus.WAITING and again.num_computed_tokens == 0
    assert (sched.loads.num_loaded_tokens, sched.loads.num_fallbacks) == (0, 0)
    assert step.step_id not in sched.loads.steps


def test_a_failed_step_forgets_its_loads() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    failed, poisoned = sched.fail_step(step.step_id, StepError("boom", kv_written=False))
    assert [o.request_id for o in failed] == ["a"] and failed[0].error is not None
    assert not poisoned           # a load commits only device hits: no block without KV
    assert step.step_id not in sched.loads.steps
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert sched.loads.num_loaded_tokens == 0 and request.num_computed_tokens == 0


def test_preempt_all_forgets_every_load() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    sched.preempt_all()
    assert step.step_id not in sched.loads.steps
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_computed_tokens == 0 and sched.loads.num_loaded_tokens == 0


def test_a_load_shares_a_step_with_a_decode() -> None:
    sched, kv, request = with_store(add=False)
    sched.add_request(make_request("b", list(range(5, 25)), max_tokens=5))
    step = run_step(sched, kv)
    sched.update(output(step, {"b": 30}))
    sched.add_request(request)
    step = run_step(sched, kv)
    assert [(r.request_id, r.num_new_tokens) for r in step.running] == [("b", 1)]
    assert [(r.request_id, r.num_new_tokens, r.num_load_tokens)
            for r in step.new_requests] == [("a", 0, 512)]
    [out] = sched.update(output(step, {"b": 31}))
    assert out.request_id == "b" and out.new_token_ids == [31]
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_computed_tokens == 512
    step = run_step(sched, kv)
    assert {r.request_id: (r.num_computed_tokens, r.num_new_tokens) for r in step.running} == {
        "b": (21, 1), "a": (512, 88)}


def test_nothing_stored_means_no_load_and_no_reports() -> None:
    sched, kv, request = with_store(num_chunks=0)
    step = run_step(sched, kv)
    [new] = step.new_requests
    assert (new.num_new_tokens, new.num_load_tokens) == (600, 0)
    assert step.step_id not in sched.loads.steps
    assert (sched.loads.num_hit_tokens, sched.loads.num_miss_tokens) == (0, 600)


def test_a_readmission_after_preemption_does_not_inflate_the_cached_tokens() -> None:
    sched, kv, request = with_store()
    step = run_step(sched, kv)
    sched.update(output(step))
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_cached_tokens == 512
    # kvcache_svc lost the pool: every request recomputes, in a fresh pool over the same store.
    sched.preempt_all()
    kv = new_kv(kv.store.store)      # type: ignore[union-attr]
    step = run_step(sched, kv)
    assert step.new_requests[0].num_load_tokens == 512
    sched.update(output(step))
    sched.loads.finish(step.step_id, loaded(step, 512, 512), sched.requests)
    assert request.num_computed_tokens == 512
    assert request.num_cached_tokens <= request.num_prompt_tokens
    assert request.num_cached_tokens == 512


# --------------------------------------------------------------------------- engine level

E_BLOCK = engine_tests.BLOCK_SIZE      # 4
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

    def answer_all(self, message: ToWorker) -> list[FromWorker]:
        if isinstance(message, InitCache):
            self.answer(message)
            return [CacheReady(worker_id=f"rank-{rank}", num_blocks=message.num_blocks)
                    for rank in range(2)]
        assert isinstance(message, StepInput)
        loads = {r.request_id: r.num_load_tokens for r in message.new_requests
                 if r.num_load_tokens}
        out = self.answer(message)
        if not loads:
            return [out]
        self.load_steps.append(message.step_id)
        reports = [KvLoaded(f"rank-{rank}", message.step_id, list(loads),
                            [min(num, self.per_rank[rank]) for num in loads.values()])
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
            time.sleep(engine_tests.STEP_S)
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
    def __init__(self, engine: ReplicaEngine, live: LiveRequests, transport: LoadingTransport,
                 worker: LoadingWorker) -> None:
        self.engine, self.live, self.transport, self.worker = engine, live, transport, worker

    def submit(self, request_id: str, prompt: list[int], max_tokens: int,
               ) -> "queue.SimpleQueue[RequestOutput]":
        request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (EOS,),
                          MAX_MODEL_LEN, E_BLOCK, hash_blocks=True)
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.live.add(request, outputs.put)
        assert self.engine.submit(request)
        return outputs


@contextmanager
def loading_replica(per_rank: tuple[int, int]) -> Iterator[LoadingReplica]:
    worker = LoadingWorker(per_rank)
    transport = LoadingTransport(worker)
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=E_CHUNK)
    put_chunks(store, E_PROMPT, E_BLOCK, 2)
    assert transport.pools is not None
    transport.pools.store = store
    downs: list[str] = []
    config = EngineConfig(
        replica_id=0, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                block_size=E_BLOCK,
                                                max_model_len=MAX_MODEL_LEN),
        num_kv_blocks=64, kv_timeout_s=2.0, step_timeout_s=10.0, ship_sampled_tokens=False,
        store_slices=SLICES)
    live = LiveRequests()
    engine = ReplicaEngine(config, lambda: transport, live.deliver,
                           lambda _id, reason, _orphans: downs.append(reason))
    engine.start()
    try:
        assert engine.ready.wait(10), "the engine did not come up"
        yield LoadingReplica(engine, live, transport, worker)
    finally:
        transport.release.set()
        worker.gate.set()
        engine.stop()
    assert transport.closed and downs == []


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
