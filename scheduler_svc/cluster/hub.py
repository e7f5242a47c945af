"""The cluster process's sockets to its engine cores and front ends, served on one thread.

- the report socket (PULL): every engine core's `EngineReport` (ready, counters, down), handed
  to `Membership.engine_report`;
- the query socket (ROUTER): each front end's `FrontendReport`, answered with the cluster's
  state (`Membership.cluster_state`), and ServerInfo's `StatsQuery`, answered with the
  cluster's statistics (stats.py) once every ready engine core has answered a
  `StatsRequest` with its counters as of its loop's last pass (or STATS_TIMEOUT_S passed);
- the same socket relays Abort by request id: an `AbortQuery` from one front end goes to every
  other, and the asker gets one `AbortAnswer` (found by any) once all answered or
  ABORT_TIMEOUT_S passed;
- a PUSH to each engine core's command socket, for `EngineStop` (queued by `stop` from any
  thread, sent from this one).

It also starts engine cores (`start`: `Membership`'s `EngineControl`) and, every
CHECK_INTERVAL_S, has membership look for engine cores that exited.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from scheduler_svc.cluster.engines import EngineProcess
from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.placement import Replica
from scheduler_svc.cluster.stats import cluster_stats_reply
from scheduler_svc.cluster.wire import (
    AbortAnswer,
    AbortQuery,
    FromFrontend,
    FrontendReport,
    StatsQuery,
)
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.wire import EngineReport, EngineStop, StatsRequest, ToEngine
from services.channels import Receiver, ReplyServer, Sender
from services.codec import Codec

log = logging.getLogger(__name__)

POLL_MS = 20
CHECK_INTERVAL_S = 0.1
ABORT_TIMEOUT_S = 0.5       # a front end that does not answer an abort query counts as "no"
STATS_TIMEOUT_S = 0.2       # ServerInfo answers with older counters of a slower engine core


@dataclass(slots=True)
class _StatsWait:
    """A front end's stats query, waiting for the engine cores' fresh counters."""

    asker: bytes
    report: FrontendReport       # the asker's counters as of its question
    waiting: set[int]            # replica ids that have not answered
    deadline: float


@dataclass(slots=True)
class _AbortRelay:
    """One front end's abort query, passed on to the others."""

    asker: bytes                 # its peer identity on the query socket
    query: AbortQuery
    waiting: set[int]            # front ends that have not answered
    found: bool
    deadline: float


class Hub:
    def __init__(self, ctx: zmq.Context, kvcache_address: str, log_level: str,
                 host: str = "127.0.0.1") -> None:
        """Binds the report and query sockets on `host`, the cluster's internal interface
        (their peers are this process's children, on this host). `membership` is attached
        before `start`."""
        self.ctx = ctx
        self.host = host
        self.kvcache_address = kvcache_address
        self.log_level = log_level
        self.reports: Receiver[EngineReport] = Receiver(ctx, Codec(EngineReport),
                                                        f"tcp://{host}:0")
        self.queries: ReplyServer[FromFrontend] = ReplyServer(ctx, Codec(FromFrontend),
                                                              f"tcp://{host}:0")
        self._stats_seq = 0
        self._stats_waits: dict[int, _StatsWait] = {}    # seq -> the query waiting
        self.membership: Membership | None = None
        self.frontends: dict[int, FrontendReport] = {}   # the latest report of each
        self._seen: dict[int, float] = {}                  # when it came (monotonic)
        self._peers: dict[int, bytes] = {}                 # its identity on the query socket
        self._aborts: dict[tuple[int, int], _AbortRelay] = {}   # (asker, query id) ->
        self._outbox: queue.SimpleQueue[tuple[str, EngineStop]] = queue.SimpleQueue()
        self._engine_codec: Codec[ToEngine] = Codec(ToEngine)
        self._to_engines: dict[str, Sender] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-hub", daemon=True)

    @property
    def query_address(self) -> str:
        return self.queries.address

    def seen_at(self, frontend: int) -> float:
        """When front end `frontend`'s latest report came (0: never)."""
        return self._seen.get(frontend, 0.0)

    # ------------------------------------------------------------------ EngineControl

    def start_engine(self, replica: Replica, config: EngineConfig) -> EngineProcess:
        membership = self.membership
        assert membership is not None
        tp = membership.config.tp_size
        addresses = [w.step_address for w in replica.ranks if w is not None]
        return EngineProcess.start(config, replica.output_address, self.reports.address,
                                   self.kvcache_address, addresses, tp, self.log_level,
                                   self.host)

    def stop_engine(self, engine: EngineProcess, reason: str) -> None:
        message = engine.stop_message(reason)
        if message is not None and engine.command_address is not None:
            self._outbox.put((engine.command_address, message))
        elif message is None and engine.command_address is None:
            engine.kill()      # not up yet: nothing to drop, nobody to tell

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for sender in self._to_engines.values():
            sender.close()
        self.reports.close()
        self.queries.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.reports.socket, zmq.POLLIN)
        poller.register(self.queries.socket, zmq.POLLIN)
        next_check = 0.0
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(POLL_MS))
                if self.reports.socket in ready:
                    self._take_reports()
                if self.queries.socket in ready:
                    self._answer_queries()
                self._send_outbox()
                now = time.monotonic()
                self._expire_aborts(now)
                self._expire_stats(now)
                if now >= next_check and self.membership is not None:
                    next_check = now + CHECK_INTERVAL_S
                    self.membership.check_engines()
            except Exception:    # never let the hub die: the cluster would go deaf
                log.exception("cluster hub pass failed")

    def _take_reports(self) -> None:
        while (report := self.reports.recv(timeout_ms=0)) is not None:
            if self.membership is not None:
                self.membership.engine_report(report)
            wait = self._stats_waits.get(report.stats_seq) if report.stats_seq else None
            if wait is not None:
                wait.waiting.discard(report.replica_id)
                if not wait.waiting:
                    self._answer_stats(report.stats_seq)

    def _answer_queries(self) -> None:
        membership = self.membership
        while (received := self.queries.recv(timeout_ms=0)) is not None:
            peer, message = received
            if membership is None:
                continue
            if isinstance(message, AbortQuery):
                self._relay_abort(peer, message)
                continue
            if isinstance(message, AbortAnswer):
                self._take_abort_answer(peer, message)
                continue
            report = message if isinstance(message, FrontendReport) else message.report
            self.frontends[report.frontend] = report
            self._seen[report.frontend] = time.monotonic()
            self._peers[report.frontend] = peer
            if isinstance(message, FrontendReport):
                self.queries.reply(peer, membership.cluster_state())
            elif isinstance(message, StatsQuery):
                self._ask_engines(peer, message.report)

    def _ask_engines(self, asker: bytes, report: FrontendReport) -> None:
        """Every ready engine core reports its counters; the query is answered once all
        have (or at STATS_TIMEOUT_S)."""
        assert self.membership is not None
        self._stats_seq += 1
        seq = self._stats_seq
        engines = [r.engine for r in self.membership.ready_replicas() if r.engine is not None]
        self._stats_waits[seq] = _StatsWait(asker, report, {e.replica_id for e in engines},
                                            time.monotonic() + STATS_TIMEOUT_S)
        for engine in engines:
            if engine.command_address is not None:
                self._send(engine.command_address, StatsRequest(seq=seq))
        if not engines:
            self._answer_stats(seq)

    def _answer_stats(self, seq: int) -> None:
        wait = self._stats_waits.pop(seq)
        assert self.membership is not None
        reports = {**self.frontends, wait.report.frontend: wait.report}
        reply = cluster_stats_reply(self.membership, list(reports.values()))
        reply.state = self.membership.cluster_state()
        self.queries.reply(wait.asker, reply)

    def _expire_stats(self, now: float) -> None:
        for seq in [seq for seq, w in self._stats_waits.items() if now >= w.deadline]:
            self._answer_stats(seq)

    def _relay_abort(self, asker: bytes, query: AbortQuery) -> None:
        others = {i: p for i, p in self._peers.items() if i != query.frontend}
        relay = _AbortRelay(asker, query, set(others), False,
                            time.monotonic() + ABORT_TIMEOUT_S)
        self._aborts[(query.frontend, query.query_id)] = relay
        for peer in others.values():
            self.queries.reply(peer, query)
        self._maybe_answer(relay)

    def _take_abort_answer(self, peer: bytes, answer: AbortAnswer) -> None:
        relay = self._aborts.get((answer.frontend, answer.query_id))
        if relay is None:
            return                      # answered already (timed out)
        answerer = next((i for i, p in self._peers.items() if p == peer), None)
        relay.waiting.discard(answerer)  # type: ignore[arg-type]
        relay.found = relay.found or answer.found
        self._maybe_answer(relay)

    def _maybe_answer(self, relay: _AbortRelay, timed_out: bool = False) -> None:
        if relay.waiting and not timed_out:
            return
        query = relay.query
        self._aborts.pop((query.frontend, query.query_id), None)
        self.queries.reply(relay.asker, AbortAnswer(frontend=query.frontend,
                                                    query_id=query.query_id,
                                                    found=relay.found))

    def _expire_aborts(self, now: float) -> None:
        for relay in [r for r in self._aborts.values() if now >= r.deadline]:
            self._maybe_answer(relay, timed_out=True)

    def _send_outbox(self) -> None:
        while True:
            try:
                address, message = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(address, message)

    def _send(self, address: str, message: EngineStop | StatsRequest) -> None:
        """To an engine core's command socket (this thread only)."""
        sender = self._to_engines.get(address)
        if sender is None:
            sender = self._to_engines[address] = Sender(self.ctx, self._engine_codec, address)
        sender.send(message)
