"""One replica's engine core loop: plan with kvcache_svc, run the step on the workers, hand
the outputs to the front ends.

Runs on a thread of its own in the replica's engine core process (scheduler_svc.engine.
service). Everything that touches the replica's `Scheduler` happens on this thread; the
command reader talks to it only through `submit` / `abort` / `hello` (a command queue), and
everything the engine has to say goes to its `EngineHost`: the step's outputs (packed per front
end), front ends' hellos, readiness, counters, and its going down.

    while serving:
        take new requests, aborts, hellos
        plan  = scheduler.schedule()          # draft (None: no plan call needed)
        reply = kvcache.plan(plan)            # one batched call, when blocks change
        step  = scheduler.apply_plan(reply)   # StepInput diff
        send step to every rank; wait for the last stage's StepOutput (ranks.py)
        host.packed(scheduler.update_packed(output)); apply the KV loads every rank reported
Failures, and who handles them:
- kvcache_svc stops answering, or answers as a new instance (another epoch, the pool gone):
  the engine finishes the steps in flight, preempts everything (recompute), and re-creates
  its pool once kvcache_svc answers again; meanwhile it admits nothing and reports
  `kv_ok = False` (readiness NOT_SERVING). No request fails.
- A step raises on the worker of a one-rank replica: the worker drops that step's requests
  and answers a StepOutput with an error; the engine fails exactly those requests (an
  explicit error to each client, blocks freed) and serves on. If the failed step may have
  left blocks without KV in the prefix index, the engine first empties the index as above
  (every running request recomputes; none fails).
- A worker is lost (the cluster's heartbeat monitor sends EngineStop, or a step times out,
  or a rank of a multi-rank replica fails a step, which may leave its peers stuck in a
  collective): the engine stops, drops its pool in kvcache_svc, and tells every front end
  it is down (`EngineHost.down`), after every output it sent: each front end moves its
  requests to another replica from prompt + the tokens its client has, the stream
  uninterrupted. Only a step a rank failed by itself (not a lost peer:
  `WorkerFailure.peer_lost`) fails its own requests first.
"""

import logging
import threading
import time
from collections import deque
from typing import Protocol

from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.inbox import Abort, Add, Command, Deliver, EngineInbox, Hello
from scheduler_svc.engine.outputs import StepPacker
from scheduler_svc.engine.ranks import EngineError, Ranks, StepFailedOnRank
from scheduler_svc.engine.request import FinishReason, Request, RequestOutput
from scheduler_svc.engine.scheduler import Scheduler
from scheduler_svc.engine.step_window import StepTimes
from scheduler_svc.engine.transport import Connect, EngineTransport
from scheduler_svc.engine.wire import EngineStats, FrontendHello
from services.kv_wire import (
    ConfigurePool,
    DropPool,
    KvAck,
    PlanReply,
)
from services.wire import (
    StepError,
    StepInput,
)

log = logging.getLogger(__name__)

KV_RETRY_S = 0.5          # between attempts to reach a lost kvcache_svc


class EngineHost(Protocol):
    """Where an engine's results go; called on the engine's thread only."""

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs of the object path: an admission's refusal, an abort's ending, a failed
        step's requests."""

    def packed(self, packer: StepPacker) -> None:
        """One step's outputs, packed per front end (the scheduler's `update_packed`)."""

    def hello(self, hello: FrontendHello) -> bool:
        """A front end says where its outputs go; True when it replaces an earlier
        incarnation of that front end (whose requests the engine then drops)."""

    def ready(self) -> None:
        """The pool and every rank's KV cache are up: the replica serves."""

    def stats(self, stats: EngineStats, now_too: bool) -> None:
        """The engine's counters after a pass of its loop; `now_too`: it just went idle, or a
        request just ended (the host reports these at once, the rest at its own pace)."""

    def kv_changed(self, kv_ok: bool) -> None:
        """kvcache_svc was lost (False) or holds the pool again (True)."""

    def down(self, reason: str) -> None:
        """The engine stops; every request it held and did not finish must move."""


class ReplicaEngine:
    def __init__(self, config: EngineConfig, connect: Connect, host: EngineHost) -> None:
        """`connect` makes the engine's transport (on the engine's thread); `host` takes
        everything it has to say."""
        self.config = config
        self.scheduler = Scheduler(config.scheduler, config.replica_id,
                                   ship_sampled_tokens=config.ship_sampled_tokens,
                                   num_batches=config.max_batches_in_flight,
                                   async_scheduling=config.async_scheduling)
        self._depth = 2 if config.async_scheduling else config.max_batches_in_flight
        self._in_flight: deque[tuple[int, float, float]] = deque()  # (step id, t0, t_sent)
        self.scheduler.set_capacity(config.num_kv_blocks)
        self._connect = connect
        self._ranks: Ranks                     # made on the engine's thread, with its transport
        self._host = host
        self._inbox = EngineInbox()           # from other threads (inbox.py)
        self._thread = threading.Thread(target=self._run, name=f"replica-{config.replica_id}",
                                        daemon=True)
        self._stopping = False
        self._down_reason: str | None = None  # set by fail_over (any thread)
        self.kv_ok = True                     # kvcache_svc reachable and holding our pool
        self._reset_pool = False              # a failed step may have poisoned the prefix index
        self.kv_epoch: int | None = None      # the kvcache_svc instance that holds it
        self.num_kv_recoveries = 0
        self.ready = threading.Event()
        self.num_steps = 0
        self.num_plans = 0
        self._times = StepTimes(config.replica_id)   # the log's windows, ServerInfo's gaps
        # The counters as of the loop's last pass, for other threads (a stats request).
        self.latest_stats = self.stats()

    # ---------------------------------------------------------------- called from other threads

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.wake()
        self._thread.join(timeout=10)

    @property
    def replica_id(self) -> int:
        return self.config.replica_id

    def submit(self, request: Request) -> bool:
        """Queues a request (new, or moved off a lost replica). False if this engine has
        already gone down (its front end hears so and moves it)."""
        return self._down_reason is None and self._inbox.add(request)

    def hello(self, hello: FrontendHello) -> None:
        self._inbox.hello(hello)

    def refuse(self, output: RequestOutput) -> None:
        """Delivers the ending of a request refused before it was submitted."""
        self._inbox.deliver(output)

    def is_running(self) -> bool:
        return self._thread.is_alive()

    def fail_over(self, reason: str) -> None:
        """A rank of this replica is gone: stop and hand the live requests back."""
        if self._down_reason is None:
            self._down_reason = reason
            self._inbox.wake()        # an idle engine notices

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        io = self._connect()
        self._ranks = Ranks(io, self.scheduler.loads, self.config.step_timeout_s,
                            self._check_down)
        try:
            self._bring_up(io)
            self.ready.set()
            self._host.ready()
            was_idle = False
            while not self._stopping:
                idle = not self.scheduler.has_work() and not self._in_flight
                self.latest_stats = self.stats()
                self._host.stats(self.latest_stats, idle and not was_idle)
                was_idle = idle
                self._check_down()
                if not self.kv_ok or self._reset_pool:
                    self._recover_kv(io)
                    continue
                self._take_commands(block=not self.scheduler.has_work() and not self._in_flight)
                self._step(io)
        except EngineError as exc:
            log.error("replica %d down: %s", self.config.replica_id, exc)
            self._go_down(io, str(exc))
        except Exception as exc:  # a bug: fail loudly, never leave clients hanging
            log.exception("replica %d engine crashed", self.config.replica_id)
            self._go_down(io, f"internal error: {exc}")
        finally:
            io.close()

    def stats(self) -> EngineStats:
        """The engine's counters now (its own thread; tests)."""
        sched = self.scheduler
        return EngineStats(
            num_kv_blocks=self.config.num_kv_blocks, num_usable_blocks=sched.num_total_blocks,
            num_free_blocks=sched.num_free_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            num_kv_recoveries=self.num_kv_recoveries, kv_ok=self.kv_ok,
            forward_gap_ms_total=self._times.gap_ms_total, num_forward_gaps=self._times.num_gaps,
            num_prompt_tokens_admitted=sched.num_prompt_tokens_admitted,
            num_cached_tokens_admitted=sched.num_cached_tokens_admitted,
            num_store_hit_tokens=sched.loads.num_hit_tokens,
            num_store_miss_tokens=sched.loads.num_miss_tokens,
            num_store_loaded_tokens=sched.loads.num_loaded_tokens,
            num_store_load_fallbacks=sched.loads.num_fallbacks, num_plans=self.num_plans)

    def _check_down(self) -> None:
        if self._down_reason is not None:
            raise EngineError(self._down_reason)

    def _go_down(self, io: EngineTransport, reason: str) -> None:
        """Drops the replica's pool and prefix index in kvcache_svc (its blocks describe KV
        that no longer exists) and tells the front ends: each moves the requests it had here
        to another replica, from prompt + the tokens its client has (nothing is lost
        silently)."""
        self._inbox.close()     # submitted but not yet taken in: their front ends move them
        if self.kv_ok:
            io.call_kv(DropPool(replica_id=self.config.replica_id), timeout_ms=1000)
        self._host.down(reason)

    def _configure_pool(self) -> ConfigurePool:
        cfg = self.config
        return ConfigurePool(replica_id=cfg.replica_id, num_blocks=cfg.num_kv_blocks,
                             block_size=cfg.scheduler.block_size,
                             enable_prefix_caching=cfg.scheduler.prefix_caching,
                             scheduler_epoch=cfg.scheduler_epoch,
                             store_slices=list(cfg.store_slices),
                             group_windows=list(cfg.scheduler.kv_group_windows))

    def _pool_made(self, ack: KvAck) -> None:
        """kvcache_svc (instance `ack.epoch`) holds our pool, saving chunks of this size."""
        self.kv_epoch = ack.epoch
        self.scheduler.kv_blocks.save_chunk_tokens = ack.save_chunk_tokens

    def _bring_up(self, io: EngineTransport) -> None:
        cfg = self.config
        ack = io.call_kv(self._configure_pool(), timeout_ms=int(cfg.kv_timeout_s * 1000))
        if not isinstance(ack, KvAck) or ack.error is not None:
            raise EngineError(f"kvcache_svc did not configure the pool: {ack}")
        self._pool_made(ack)
        self._ranks.init_caches(cfg.num_kv_blocks, cfg.scheduler.block_size)
        log.info("replica %d ready: %d KV blocks of %d tokens", cfg.replica_id,
                 cfg.num_kv_blocks, cfg.scheduler.block_size)

    def _take_commands(self, block: bool, timeout_s: float | None = None) -> None:
        for command in self._inbox.take(block, timeout_s):
            self._apply_command(command)

    def _apply_command(self, command: Command) -> None:
        if isinstance(command, Add):
            request = command.request
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:   # it can never run here (INVALID_ARGUMENT)
                self._host.outputs([RequestOutput(request.request_id, [], [],
                                                  FinishReason.ABORT, error=str(exc),
                                                  invalid=True, frontend=request.frontend,
                                                  handle=request.handle)])
        elif isinstance(command, Abort):
            final = self.scheduler.abort(command.request_id)
            if final is not None:
                self._host.outputs([final])
        elif isinstance(command, Deliver):
            self._host.outputs([command.output])
        elif isinstance(command, Hello):
            if self._host.hello(command.hello):
                # A restarted front end: its earlier incarnation's clients are gone (their
                # endings go to the new one, which knows none of them and drops them).
                frontend = command.hello.frontend
                ended = [self.scheduler.abort(request.request_id)
                         for request in list(self.scheduler.requests.values())
                         if request.frontend == frontend]
                self._host.outputs([out for out in ended if out is not None])

    def _step(self, io: EngineTransport) -> None:
        """Sends a new step while the queue has room and something can run; otherwise
        applies the oldest step's output (outputs come back in step order)."""
        sent = False
        if len(self._in_flight) < self._depth and self.scheduler.has_schedulable():
            sent = self._send_step(io)
            if sent and len(self._in_flight) < self._depth:
                return  # fill the queue before waiting
        if self._in_flight:
            self._receive_oldest(io)
        elif self.scheduler.loads.steps:
            self._await_loads(io)
        elif not sent:
            # Nothing fit (the free-block estimate was off; the next plan starts from
            # kvcache_svc's exact count), or the plan only freed blocks (the scheduler has
            # nothing left to send then, and the run loop blocks): wait briefly for news.
            self._take_commands(True, 0.002)

    def _send_step(self, io: EngineTransport) -> bool:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:            # the step runs on blocks its requests hold
            return self._send(io, self.scheduler.apply_plan(None), started)
        self.num_plans += 1
        reply = io.call_kv(plan, timeout_ms=int(self.config.kv_timeout_s * 1000))
        if not isinstance(reply, PlanReply) or reply.epoch != self.kv_epoch:
            # Unreachable, or a restarted instance that does not have our pool: nothing of
            # this plan happened; recover before the next one.
            self.scheduler.discard_draft()
            what = ("did not answer the plan call" if not isinstance(reply, PlanReply)
                    else f"restarted (epoch {self.kv_epoch} -> {reply.epoch})")
            log.warning("replica %d: kvcache_svc %s; preempting and re-planning",
                        self.config.replica_id, what)
            self._set_kv_ok(False)
            return False
        return self._send(io, self.scheduler.apply_plan(reply), started)

    def _send(self, io: EngineTransport, step: StepInput | None, started: float) -> bool:
        if step is None:
            return False
        io.send_to_ranks(step)
        self._in_flight.append((step.step_id, started, time.perf_counter()))
        return True

    def _receive_oldest(self, io: EngineTransport) -> None:
        step_id, started, sent = self._in_flight.popleft()
        try:
            output = self._ranks.wait_output(step_id)
        except StepFailedOnRank as exc:
            self._fail_step(step_id, StepError(str(exc)[:4096], kv_written=False))
            raise
        received = time.perf_counter()
        self.num_steps += 1
        if output.error is not None:
            self._fail_step(output.step_id, output.error)
            return
        packer = StepPacker()
        self.scheduler.update_packed(output, packer)
        self._host.packed(packer)
        if any(p.finished for p in packer.packers.values()):
            # Counters as of a request's end reach the cluster right behind its last output:
            # a client that reads ServerInfo or /metrics next sees its request counted.
            self._host.stats(self.stats(), True)
        self._finish_loads(io.num_ranks)
        self._times.record(started, sent, received, time.perf_counter(), output.timings)

    def _fail_step(self, step_id: int, error: StepError) -> None:
        failed, poisoned = self.scheduler.fail_step(step_id, error)
        log.error("replica %d: the worker failed step %d (%s); failing its %d requests%s",
                  self.config.replica_id, step_id, error.message, len(failed),
                  "; emptying the prefix index" if poisoned else "")
        self._host.outputs(failed)
        if poisoned:
            self._reset_pool = True

    def _finish_loads(self, num_ranks: int) -> None:
        """Applies the KV loads every rank has reported (store_loads.py); a load a rank has
        not reported within the step timeout takes the replica down."""
        loads = self.scheduler.loads
        loads.finish_reported(num_ranks, self.scheduler.requests)
        if (late := loads.overdue(self.config.step_timeout_s)) is not None:
            raise EngineError(f"a rank did not report the KV loads of step {late} within "
                              f"{self.config.step_timeout_s:.0f}s")

    def _await_loads(self, io: EngineTransport) -> None:
        """Nothing in flight but loads: the ranks' messages for 5 ms (then new requests)."""
        self._ranks.poll_loads()
        self._finish_loads(io.num_ranks)

    # ---------------------------------------------------------------- kvcache_svc recovery

    def _set_kv_ok(self, ok: bool) -> None:
        if self.kv_ok != ok:
            self.kv_ok = ok
            self._host.kv_changed(ok)

    def _recover_kv(self, io: EngineTransport) -> None:
        """kvcache_svc lost our pool, or its prefix index may name blocks without KV (a
        failed step): let the steps in flight finish (their KV is on the workers and their
        tokens are good), preempt every request (recompute; the workers drop their state with
        the next step), and re-create the pool once kvcache_svc answers. Requests keep
        arriving meanwhile; none is admitted until then."""
        while self._in_flight:
            self._receive_oldest(io)
        self.scheduler.preempt_all()
        cfg = self.config
        configure = self._configure_pool()
        while not self._stopping:
            self._check_down()
            ack = io.call_kv(configure, timeout_ms=int(KV_RETRY_S * 1000))
            if isinstance(ack, KvAck) and ack.error is None:
                self._pool_made(ack)
                self.num_kv_recoveries += 1
                self._reset_pool = False
                log.info("replica %d: pool re-created in kvcache_svc (epoch %d); %d requests "
                         "resume by recompute", cfg.replica_id, ack.epoch,
                         len(self.scheduler.waiting))
                self._set_kv_ok(True)
                return
            self._take_commands(True, KV_RETRY_S)
