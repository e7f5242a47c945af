"""The engine core process of one replica: its sockets, its command reader, and the host that
takes what its `ReplicaEngine` (scheduler_svc.engine.core) says.

Started by the cluster (scheduler_svc.cluster.engines) once every rank of the replica has
reported its capacity, as `python -m scheduler_svc.engine` with an `EngineLaunch` on stdin.

Sockets: the replica's worker-output PULL (bound at the address the workers were given at
registration), a command PULL on the cluster's internal interface (front ends' requests and
aborts, the cluster's stop and stats requests), a PUSH to each front end's output socket (made
when the front end says hello), and PUSHes to the cluster's report socket (one for the
engine's thread, one for the command reader, which answers stats requests at once from the
counters the engine's loop left at its last pass). The engine loop runs on a thread of its
own; the command reader on another; compiled grammars are deserialized on a third, in
arrival order, so a large one delays only its own request.
"""

import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

from scheduler_svc.engine.core import ReplicaEngine
from scheduler_svc.engine.grammar import GrammarBook, GrammarError
from scheduler_svc.engine.outputs import StepPacker, down_message
from scheduler_svc.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from scheduler_svc.engine.transport import ZmqTransport
from scheduler_svc.engine.wire import (
    EngineAbort,
    EngineLaunch,
    EngineOutputs,
    EngineReport,
    EngineRequest,
    EngineStats,
    EngineStop,
    FrontendHello,
    GrammarVocabulary,
    StatsRequest,
    ToEngine,
)
from services import heap
from services.channels import Receiver, Sender
from services.codec import Codec
from services.wire import FromWorker

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1     # counters reported at most this often while busy (and when idle)


class FrontendLinks:
    """The engine's side of its front ends and the cluster: an `EngineHost`. Used on the
    engine's thread only (ZMQ sockets belong to one thread)."""

    def __init__(self, ctx: zmq.Context, launch: EngineLaunch, command_address: str) -> None:
        self.ctx = ctx
        self.replica_id = launch.config.replica_id
        self.epoch = launch.engine_epoch
        self.command_address = command_address
        self._codec: Codec[EngineOutputs] = Codec(EngineOutputs)
        self._frontends: dict[int, tuple[int, Sender]] = {}   # index -> (epoch, its socket)
        self._report = Sender(ctx, Codec(EngineReport), launch.report_address)
        self._last_stats = 0.0
        self.is_ready = False

    def outputs(self, outputs: list[RequestOutput]) -> None:
        packer = StepPacker()
        packer.add(outputs)
        self.packed(packer)

    def packed(self, packer: StepPacker) -> None:
        for frontend, message in packer.messages(self.replica_id, self.epoch).items():
            link = self._frontends.get(frontend)
            if link is None:
                log.warning("outputs for front end %d, which never said hello; dropped",
                            frontend)
                continue
            link[1].send(message)

    def hello(self, hello: FrontendHello) -> bool:
        old = self._frontends.get(hello.frontend)
        if old is not None and old[0] == hello.epoch:
            return False
        if old is not None:
            old[1].close()
        self._frontends[hello.frontend] = (
            hello.epoch, Sender(self.ctx, self._codec, hello.output_address))
        log.info("front end %d (epoch %d) takes its outputs at %s", hello.frontend,
                 hello.epoch, hello.output_address)
        return old is not None

    def ready(self) -> None:
        self.is_ready = True
        self._send_report(None, None)

    def stats(self, stats: EngineStats, now_too: bool) -> None:
        """Reported every STATS_INTERVAL_S while busy; at once when the engine goes idle or
        a request ended (once per such pass: `now_too`)."""
        now = time.monotonic()
        if now_too or now - self._last_stats >= STATS_INTERVAL_S:
            self._last_stats = now
            self._send_report(stats, None)

    def kv_changed(self, kv_ok: bool) -> None:
        self._last_stats = 0.0            # the next pass reports at once

    def down(self, reason: str) -> None:
        message = down_message(self.replica_id, self.epoch, reason)
        for _, sender in self._frontends.values():
            sender.send(message)
        self._send_report(None, reason)

    def send_stats(self, stats: EngineStats) -> None:
        self._send_report(stats, None)

    def _send_report(self, stats: EngineStats | None, down: str | None) -> None:
        self._report.send(EngineReport(
            replica_id=self.replica_id, engine_epoch=self.epoch, ready=self.is_ready,
            command_address=self.command_address, stats=stats,
            down=None if down is None else down[:4096]))

    def close(self) -> None:
        for _, sender in self._frontends.values():
            sender.close()
        self._report.close()


class CommandReader:
    """Reads the command socket on its own thread and hands each command to the engine."""

    def __init__(self, commands: Receiver[ToEngine], engine: ReplicaEngine,
                 launch: EngineLaunch, reports: Sender) -> None:
        self.commands = commands
        self.engine = engine
        self.config = launch.config
        self.epoch = launch.engine_epoch
        self.reports = reports                # this thread's own socket to the cluster
        self.grammars = GrammarBook(launch.config.vocab_size)
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiling: set[str] = set()     # ids waiting for their grammar (abortable)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commands", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.reports.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self.commands.recv(timeout_ms=100)
            if message is None:
                continue
            try:
                self.handle(message)
            except Exception:    # a bug: keep serving the others
                log.exception("command %s failed", type(message).__name__)

    def handle(self, message: ToEngine) -> None:
        if isinstance(message, EngineRequest):
            request = self.make_request(message)
            if message.grammar is None:
                self.engine.submit(request)
            else:
                with self._lock:
                    self._compiling.add(request.request_id)
                self._grammar_pool.submit(self._with_grammar, request, message.grammar)
        elif isinstance(message, EngineAbort):
            for request_id in message.request_ids:
                with self._lock:
                    compiling = request_id in self._compiling
                    self._compiling.discard(request_id)
                if not compiling:
                    self.engine.abort(request_id)
        elif isinstance(message, FrontendHello):
            self.engine.hello(message)
        elif isinstance(message, GrammarVocabulary):
            self._grammar_pool.submit(self._set_vocabulary, message.vocabulary)
        elif isinstance(message, EngineStop):
            log.warning("the cluster stops replica %d: %s", self.config.replica_id,
                        message.reason)
            self.engine.fail_over(message.reason)
        elif isinstance(message, StatsRequest):
            self.reports.send(EngineReport(
                replica_id=self.config.replica_id, engine_epoch=self.epoch,
                ready=self.engine.ready.is_set(), command_address=self.commands.address,
                stats=self.engine.latest_stats, stats_seq=message.seq))

    def make_request(self, m: EngineRequest) -> Request:
        sched = self.config.scheduler
        sampling = SamplingParams.from_spec(m.sampling, m.max_tokens, m.min_tokens,
                                            tuple(m.stop_token_ids), m.ignore_eos)
        return Request(m.request_id, m.token_ids, sampling, self.config.eos_token_ids,
                       sched.max_model_len, sched.block_size,
                       hash_blocks=sched.prefix_caching, cache_salt=m.cache_salt,
                       num_prompt_tokens=min(m.num_prompt_tokens, len(m.token_ids)),
                       frontend=m.frontend, handle=m.handle, client=m.client)

    def _set_vocabulary(self, vocabulary: bytes) -> None:
        try:
            self.grammars.set_vocabulary(vocabulary)
        except GrammarError as exc:
            log.error("%s", exc)

    def _with_grammar(self, request: Request, grammar: bytes) -> None:
        """On the grammar thread: the request's grammar state, then the request runs."""
        error = None
        try:
            request.grammar = self.grammars.state(grammar, request.output_token_ids)
        except GrammarError as exc:
            error = str(exc)
        with self._lock:
            if request.request_id not in self._compiling:
                return                              # aborted meanwhile
            self._compiling.discard(request.request_id)
        if error is None:
            self.engine.submit(request)
        else:
            self.engine.refuse(RequestOutput(
                request.request_id, [], [], FinishReason.ABORT, error=error, invalid=True,
                frontend=request.frontend, handle=request.handle))


def serve(launch: EngineLaunch) -> int:
    """Runs the replica's engine core until it goes down or is told to stop; the exit code."""
    cfg = launch.config
    ctx = zmq.Context()
    commands: Receiver[ToEngine] = Receiver(ctx, Codec(ToEngine),
                                            f"tcp://{launch.command_host}:0")
    links = FrontendLinks(ctx, launch, commands.address)
    outputs: Receiver[FromWorker] = Receiver(ctx, Codec(FromWorker),
                                             launch.worker_output_address)

    def connect() -> ZmqTransport:
        return ZmqTransport(ctx, launch.kvcache_address, list(launch.worker_step_addresses),
                            outputs, tp_size=launch.tp_size)

    engine = ReplicaEngine(cfg, connect, links)
    reader = CommandReader(commands, engine, launch,
                           Sender(ctx, Codec(EngineReport), launch.report_address))
    stopping = threading.Event()
    # The cluster stops its engine cores (EngineStop, or SIGKILL), and they die with it: a
    # SIGTERM to the whole process group must not end the requests the cluster is draining.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("replica %d engine core (epoch %d): commands on %s, worker outputs on %s",
             cfg.replica_id, launch.engine_epoch, commands.address,
             launch.worker_output_address)
    heap.settle()
    reader.start()
    engine.start()
    try:
        while engine.is_running():
            stopping.wait(0.2)
    finally:
        engine.stop()
        reader.stop()
        commands.close()
        links.close()
        ctx.destroy(linger=0)
    return 0
