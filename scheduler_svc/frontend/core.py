"""The client-facing core of one front end: turns a prompt into token ids, validates, sends the
request to a replica's engine core and turns each step message that comes back into text for
the client's stream. No protobuf here; `servicer.py` adapts it to gRPC.

Everything runs on the front end's event loop but three kinds of work: prompts are rendered
and tokenized on a small thread pool (scheduler_svc.frontend.prompts), grammars compile on
their own bounded pool within `--max-grammar-compile-s` (scheduler_svc.frontend.grammar_pool),
and the prefix query of routing runs on the router's thread.

A request's life here: `generate` registers it (parked) and dispatches it: the router picks a
ready replica from the cluster's state and the request goes to its engine core as token ids.
Each `EngineOutputs` the engine core sends for this front end (`take_outputs`) is fanned out
to its requests (scheduler_svc.frontend.requests): each appends its tokens, detokenizes them
and checks its stop strings (a match aborts it on the engine core, and the tokens computed
after it are never sent), then puts the output on its stream. An engine core that goes down
(its own last message, or the cluster's state listing it gone) has its requests dispatched
again from prompt + the tokens their clients have.
"""

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass

from scheduler_svc.cluster.wire import ClusterState, FrontendReport, ReplicaEntry
from scheduler_svc.engine.request import FinishReason
from scheduler_svc.engine.wire import (
    EngineAbort,
    EngineOutputs,
    EngineRequest,
    engine_request_id,
)
from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer
from scheduler_svc.frontend.generation_config import GenerationDefaults
from scheduler_svc.frontend.grammar import Grammars
from scheduler_svc.frontend.links import EngineLinks
from scheduler_svc.frontend.metrics import RequestMetrics, RequestTimer
from scheduler_svc.frontend.prompts import TOKENIZER_THREADS, PreparedRequest, PromptInput, Prompts
from scheduler_svc.frontend.requests import FrontRequest, LiveRequests, Placement
from scheduler_svc.frontend.router import Router
from scheduler_svc.frontend.streams import OutputStream, RequestOutput
from scheduler_svc.frontend.tokenizer import TextTokenizer
from scheduler_svc.frontend.validation import (
    InvalidRequest,
    Limits,
    RawSampling,
    validate_cache_salt,
    validate_model,
    validate_prompt,
    validate_request_id,
    validate_sampling,
)

log = logging.getLogger(__name__)

MAX_GONE = 1024           # engine cores remembered as down
CLIENT_RESERVE_DIVISOR = 4  # a quarter of the live requests is kept from any one client

# Whose call the requests `generate` makes now belong to, for their turn in the engine core's
# waiting queue (scheduler_svc.engine.fair_queue): set by the servicer for the call it serves,
# so every choice of the call (n > 1, tasks of their own) inherits it. Empty: no client.
calling_client: ContextVar[str] = ContextVar("calling_client", default="")


class Draining(RuntimeError):
    """The server takes no new requests (draining): UNAVAILABLE."""


class QueueFull(RuntimeError):
    """Too many live requests (RESOURCE_EXHAUSTED)."""


class RequestFailed(RuntimeError):
    """The request ended without finishing; the message says why. UNAVAILABLE (its replica
    was lost and none came back in time), or INTERNAL where `server_fault` (a step failed)."""

    def __init__(self, message: str, server_fault: bool = False) -> None:
        super().__init__(message)
        self.server_fault = server_fault


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the front end knows of the model and the engine cores' policy."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int


class Frontend:
    def __init__(self, index: int, tokenizer: TextTokenizer, limits: Limits, facts: ModelFacts,
                 router: Router, engines: EngineLinks, max_live_requests: int,
                 replica_wait_s: float = 60.0, metrics: RequestMetrics | None = None,
                 tokenizer_threads: int = TOKENIZER_THREADS,
                 grammars: Grammars | None = None, stream_interval: int = 1,
                 generation_defaults: GenerationDefaults | None = None) -> None:
        """`grammars`: structured output's compiler (None: such requests are refused).
        `stream_interval`: tokens per client stream message (OutputStream).
        `generation_defaults`: the model's sampling defaults for fields a request leaves unset
        (--generation-config)."""
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.index = index
        self.epoch = engines.epoch
        self.tokenizer = tokenizer
        self.limits = limits
        self.facts = facts
        self.router = router
        self.engines = engines
        self.live = LiveRequests()
        self.max_live_requests = max_live_requests
        self.stream_interval = stream_interval      # tokens per stream message (OutputStream)
        # How long a request may wait for a ready replica (at start, or after its replica
        # was lost with no other left), unless the client's deadline comes first.
        self.replica_wait_s = replica_wait_s
        self.prompts = Prompts(tokenizer, limits, grammars, tokenizer_threads)
        self.metrics = metrics
        self.grammars = grammars
        self.num_requests_total = 0
        self.num_migrations = 0
        self.draining = False               # this front end takes no new requests
        self.state: ClusterState | None = None   # the cluster's, as last heard
        # Engine cores heard to be down (their own last message, or the cluster's state,
        # whichever came first): never routed to again, their requests moved once.
        self._gone: set[Placement] = set()
        self._gone_order: deque[Placement] = deque()
        self._dispatching: set[asyncio.Task[None]] = set()

    @property
    def num_live(self) -> int:
        return len(self.live)

    @property
    def ready(self) -> bool:
        """Readiness: a replica serves, kvcache_svc answers, and nobody is draining."""
        state = self.state
        return (state is not None and bool(self._ready()) and state.kv_reachable
                and not state.draining and not self.draining)

    def close(self) -> None:
        self.prompts.close()

    def report(self) -> FrontendReport:
        return FrontendReport(frontend=self.index, epoch=self.epoch, num_live=len(self.live),
                              num_parked=self.live.num_parked,
                              num_requests_total=self.num_requests_total,
                              num_migrations=self.num_migrations)

    # ------------------------------------------------------------------ prompts

    async def prepare(self, request_id: str, model: str, prompt: PromptInput,
                      raw: RawSampling, cache_salt: str = "") -> PreparedRequest:
        validate_model(model, self.limits)
        validate_request_id(request_id)
        salt = validate_cache_salt(cache_salt)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        _, token_ids = await self.prompts.render(prompt)
        # Again: another request may have taken the id while this one was tokenized.
        if request_id in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        max_kv_tokens = self.state.max_kv_tokens if self.state is not None else None
        limits = dataclasses.replace(self.limits, max_kv_tokens=max_kv_tokens)
        validate_prompt(token_ids, limits)
        raw = self.generation_defaults.apply(raw, limits.max_model_len - len(token_ids))
        sampling = validate_sampling(raw, len(token_ids), limits)
        grammar = None
        if sampling.structured_output is not None:
            grammar = await self.prompts.compile_grammar(sampling.structured_output)
        return PreparedRequest(request_id, token_ids, sampling, salt, grammar)

    def check_room(self, client: str) -> None:
        """QueueFull unless `client` may have one more live request here (a quarter of the
        table is kept from any one client); asked before tokenizing too: cheap refusals."""
        if len(self.live) >= self.max_live_requests:
            raise QueueFull(f"{len(self.live)} requests are live; try again later")
        most = self.max_live_requests - self.max_live_requests // CLIENT_RESERVE_DIVISOR
        if self.live.num_of(client) >= most:
            raise QueueFull(f"this client has {self.live.num_of(client)} requests live, the "
                            f"most one client may hold (a front end holds "
                            f"{self.max_live_requests}, a quarter kept for other clients); "
                            f"try again later")

    # ------------------------------------------------------------------ a request's life

    async def generate(self, prepared: PreparedRequest, time_remaining: float | None = None,
                       whole: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step message that produced tokens for it (`whole`:
        one for them all); the last one has a finish_reason. Aborts the request if the
        consumer stops early (client cancelled). `time_remaining`: seconds to the client's
        deadline, if it set one. Raises InvalidRequest if the replica refuses it (it can never
        run there)."""
        if self.draining or (self.state is not None and self.state.draining):
            raise Draining("the server is draining; send new requests elsewhere")
        self.check_room(calling_client.get())
        now = time.monotonic()
        # End before the client's own deadline fires.
        client_deadline = None if time_remaining is None else now + time_remaining - 0.5
        request = self.make_request(prepared, now + self.replica_wait_s,
                                    OutputStream(None if whole else self.stream_interval))
        request.client_deadline = client_deadline
        self._set_deadline(request, now)
        if not self.live.add(request):
            raise InvalidRequest(f"request_id {prepared.request_id!r} is already in use")
        self.num_requests_total += 1
        finished = False
        try:
            await self.dispatch(request)
            while True:
                out = await request.stream.get()
                if out.error is not None:
                    finished = True
                    if out.invalid:         # refused by the replica it was dispatched to
                        raise InvalidRequest(out.error)
                    raise RequestFailed(out.error, out.server_fault)
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request)
            self.live.remove(request)

    def make_request(self, prepared: PreparedRequest, deadline: float,
                     stream: OutputStream) -> FrontRequest:
        handle = self.live.new_handle()
        return FrontRequest(
            request_id=prepared.request_id, handle=handle,
            engine_id=engine_request_id(prepared.request_id, self.index, handle),
            prompt_token_ids=prepared.prompt_token_ids, sampling=prepared.sampling,
            cache_salt=prepared.cache_salt, grammar=prepared.grammar, stream=stream,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer.tokenizer, prepared.prompt_token_ids,
                prepared.sampling.skip_special_tokens, prepared.sampling.stop),
            timer=RequestTimer(self.metrics), deadline=deadline, client=calling_client.get())

    def _set_deadline(self, request: FrontRequest, now: float) -> None:
        """A parked request waits for a ready replica `replica_wait_s` (at start, or after its
        replica was lost), or until its client's deadline, whichever comes first."""
        request.deadline = now + self.replica_wait_s
        if request.client_deadline is not None:
            request.deadline = min(request.deadline, max(now, request.client_deadline))

    def cancel(self, request: FrontRequest) -> None:
        """The one way a request is cancelled (its client went away, or Abort): aborted on
        its engine core, if it runs; its stream ends with an ABORT output."""
        if request.done:
            return
        self._abort_on_engine(request)
        request.finish(FinishReason.ABORT, None, None)

    def cancel_id(self, request_id: str) -> bool:
        """Abort by the client's id; False if no such request is live here."""
        request = self.live.by_id(request_id)
        if request is None:
            return False
        self.cancel(request)
        return True

    def _abort_on_engine(self, request: FrontRequest) -> None:
        """Its engine core drops it (one that left the ready list, its pool being re-made,
        still runs it: any engine core this front end sent to is reachable)."""
        if request.placement is not None:
            self.engines.send_known(request.placement,
                                    EngineAbort(request_ids=[request.engine_id]))

    # ------------------------------------------------------------------ placing requests

    def _entry(self, placement: Placement) -> ReplicaEntry | None:
        return next((r for r in self._ready() if (r.replica_id, r.engine_epoch) == placement),
                    None)

    def _ready(self) -> list[ReplicaEntry]:
        """The replicas to route to: the cluster's ready ones, less those heard to be down
        since (an engine core's last message comes before the cluster's next state)."""
        state = self.state
        if state is None:
            return []
        return [r for r in state.ready if (r.replica_id, r.engine_epoch) not in self._gone]

    async def dispatch(self, request: FrontRequest) -> None:
        """Sends a parked request to the best ready replica's engine core, or leaves it parked
        until one is ready (the cluster state's next update tries again)."""
        ready = self._ready()
        if (not ready or request.done or request.dispatching
                or request.placement is not None):
            return
        if self._finished_already(request):
            return
        cached: dict[int, int] = {}
        kv_reachable = self.state is not None and self.state.kv_reachable
        if self.router.needs_query(request, ready, kv_reachable):
            request.dispatching = True
            try:
                cached = await self.router.cached_blocks(self.router.block_hashes(request))
            finally:
                request.dispatching = False
            if request.done or request.placement is not None:
                return
            ready = self._ready()
        entry = self.router.choose(request, ready, cached, self.live.num_on)
        if entry is None:
            return
        placement = (entry.replica_id, entry.engine_epoch)
        if request.grammar is not None and self.grammars is not None:
            self.engines.send_vocabulary(placement, entry.address, self.grammars.vocabulary())
        s = request.sampling
        self.engines.send(placement, entry.address, EngineRequest(
            frontend=self.index, handle=request.handle, request_id=request.engine_id,
            token_ids=request.token_ids, num_prompt_tokens=len(request.prompt_token_ids),
            sampling=s.to_spec(), max_tokens=s.max_tokens, min_tokens=s.min_tokens,
            stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
            cache_salt=request.cache_salt,
            grammar=None if request.grammar is None else request.grammar.serialized,
            client=request.client))
        self.live.place(request, placement)

    def _finished_already(self, request: FrontRequest) -> bool:
        """A request moved off a lost replica whose outputs already end it (the engine core
        went down before its ending came): it finishes here instead of running again."""
        outputs, s = request.output_token_ids, request.sampling
        if not outputs:
            return False
        last = outputs[-1]
        if len(outputs) >= s.min_tokens and (
                (not s.ignore_eos and last in self.facts.eos_token_ids)
                or last in s.stop_token_ids):
            request.finish(FinishReason.STOP, last if last in s.stop_token_ids else None, None)
            return True
        if len(outputs) >= s.max_tokens or len(request.token_ids) >= self.limits.max_model_len:
            request.finish(FinishReason.LENGTH, None, None)
            return True
        return False

    def _dispatch_soon(self, request: FrontRequest) -> None:
        task = asyncio.ensure_future(self.dispatch(request))
        self._dispatching.add(task)
        task.add_done_callback(self._dispatch_done)

    def _dispatch_done(self, task: "asyncio.Task[None]") -> None:
        self._dispatching.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("dispatching a request failed", exc_info=task.exception())

    def take_state(self, state: ClusterState) -> None:
        """The cluster's state (every STATE_INTERVAL_S): engine cores gone take their
        requests down with them (moved), parked requests are placed or expire."""
        self.state = state
        for replica_id, epoch in state.gone:
            if (replica_id, epoch) not in self._gone:
                self._engine_down((replica_id, epoch), "its engine core went down")
        now = time.monotonic()
        ready = bool(self._ready())
        for request in self.live.parked():
            if now >= request.deadline:
                request.fail("no replica became ready before the request's deadline")
            elif ready:
                self._dispatch_soon(request)

    def _engine_down(self, placement: Placement, reason: str) -> None:
        """Every request placed there moves: parked and dispatched again."""
        if placement not in self._gone:
            self._gone.add(placement)
            self._gone_order.append(placement)
            if len(self._gone_order) > MAX_GONE:
                self._gone.discard(self._gone_order.popleft())
        self.engines.forget(placement)
        now = time.monotonic()
        for request in self.live.placed_on(placement):
            if request.done:                        # its client has every output
                continue
            if request.stop_string is not None:     # its ending was only waiting on counts
                request.finish(FinishReason.STOP, request.stop_string, None)
                continue
            self.live.park(request)
            self._set_deadline(request, now)
            request.num_migrations += 1
            self.num_migrations += 1
            log.info("request %s (%d tokens out) moves off replica %d: %s", request.request_id,
                     len(request.output_token_ids), placement[0], reason)
            self._dispatch_soon(request)

    # ------------------------------------------------------------------ outputs

    def take_outputs(self, message: EngineOutputs) -> None:
        """One engine core's step message for this front end's requests."""
        placement = (message.replica_id, message.engine_epoch)
        for request in self.live.take_outputs(message, placement, self.facts.vocab_size):
            self._abort_on_engine(request)      # a stop string matched
        if self.metrics is not None:
            self.metrics.flush()                # the step's token timings, written once
        if message.down is not None:
            self._engine_down(placement, message.down)
