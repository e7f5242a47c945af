"""Every live request of one front end: its client-side state (prompt, the tokens its client
has, its detokenizer and stream) and where it runs (a replica's engine core, or none while it
is parked waiting for one).

The front end (core.py) adds a request when its stream opens and removes it when the stream
ends; it places, parks and moves it. Each engine core step message for this front end is
fanned out here (`LiveRequests.take_outputs`): every request it names appends its tokens,
detokenizes them and checks its stop strings (`FrontRequest.take`), and hands its stream
what the stream wants. The engine core holds the request's scheduling state;
what is here is enough to run it again anywhere: prompt + outputs so far (a lost replica's
requests move token-exact). Everything here runs on the front end's event loop: no locks.
"""

import logging
from collections import Counter
from dataclasses import dataclass, field

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.engine.wire import EngineOutputs, Finished, HandlePromptLogprobs, unpack_ints
from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer
from scheduler_svc.frontend.grammar import CompiledGrammar
from scheduler_svc.frontend.metrics import RequestTimer
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.streams import OutputStream, RequestOutput
from services.wire import TokenLogprobs

log = logging.getLogger(__name__)

Placement = tuple[int, int]        # (replica id, engine core epoch)
FINISH_REASONS = {reason.value: reason for reason in FinishReason}


@dataclass(slots=True, eq=False)
class FrontRequest:
    request_id: str                    # the client's id (a choice's: <id>-<index>)
    handle: int                        # this front end's name for it, in engine messages
    engine_id: str                     # the engine core's id for it (engine.wire)
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: bytes
    grammar: CompiledGrammar | None
    stream: OutputStream
    detokenizer: IncrementalDetokenizer
    timer: RequestTimer
    deadline: float                    # time.monotonic() by which it must have a replica
    client_deadline: float | None = None   # its client's own (monotonic), if it set one
    client: str = ""                   # whose call it is: its turn on the engine (EngineRequest)
    output_token_ids: list[int] = field(default_factory=list)   # what its client has
    # Of those, how many its stream was handed (the rest wait for the stream's interval:
    # --stream-interval, or the end for a client that takes the whole output), and the
    # logprobs and prompt logprobs not handed yet.
    num_sent: int = 0
    unsent_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    unsent_prompt_logprobs: list[tuple[int, TokenLogprobs, int]] | None = None
    placement: Placement | None = None  # where it runs; None: parked
    stop_string: str | None = None     # a stop string matched: ending, its abort sent
    dispatching: bool = False          # being routed (its prefix query is out)
    done: bool = False                 # its last output is on the stream
    num_migrations: int = 0
    block_hashes: list[bytes] | None = None   # its prompt's, for prefix-aware routing

    @property
    def token_ids(self) -> list[int]:
        """Prompt + outputs so far: what an engine core runs it from."""
        return self.prompt_token_ids + self.output_token_ids

    # What one step made for it, on its way to its stream.

    def take(self, tokens: list[int], logprobs: list[TokenLogprobs | None],
             fin: Finished | None, plps: HandlePromptLogprobs | None) -> bool:
        """Its tokens from one step (stop strings checked; held until its stream wants them),
        its prompt logprobs, its ending if the engine core ended it. True when a stop string
        matched before the engine core ended it: the caller aborts it there (the ending waits
        for the engine core's, with the usage counts)."""
        abort = False
        if self.stop_string is None:
            detok = self.detokenizer
            min_tokens = self.sampling.min_tokens
            keep_stop = self.sampling.include_stop_str_in_output
            outputs = self.output_token_ids
            num_before = len(outputs)
            for token_id, lp in zip(tokens, logprobs, strict=True):
                outputs.append(token_id)
                self.unsent_logprobs.append(lp)
                matched = detok.update(token_id, len(outputs) >= min_tokens, keep_stop)
                if matched is not None:
                    self.stop_string = matched
                    abort = fin is None
                    break
            if len(outputs) > num_before and self.placement is not None:
                # Timed as the step's message arrives, whenever its client takes them.
                self.timer.tokens(len(outputs) - num_before, self.placement[0])
        if plps is not None:
            self.unsent_prompt_logprobs = list(zip(plps.token_ids, plps.logprobs, plps.ranks,
                                                   strict=False))
        if fin is not None:
            if fin.error is not None and self.stop_string is None:
                self.fail(fin.error, fin.server_fault, fin.invalid)
            elif self.stop_string is not None:
                self.finish(FinishReason.STOP, self.stop_string, fin)
            else:
                self.finish(FINISH_REASONS.get(fin.reason, FinishReason.ABORT),
                            fin.stop_token_id, fin)
            return abort
        num_unsent = len(self.output_token_ids) - self.num_sent
        if self.unsent_prompt_logprobs is not None or (
                num_unsent and self.stream.wants(num_unsent)):
            self.stream.put(self.unsent(False))
        return abort

    def take_token(self, token_id: int) -> bool:
        """`take([token_id], [None], None, None)` for a plain decode step's row (one token, no
        logprobs, no ending): the same outcome without the per-row lists and loop, as every
        streamed token passes here (tests/scheduler_svc/frontend/test_requests.py compares
        the two)."""
        abort = False
        outputs = self.output_token_ids
        if self.stop_string is None:
            outputs.append(token_id)
            self.unsent_logprobs.append(None)
            sampling = self.sampling
            matched = self.detokenizer.update(token_id, len(outputs) >= sampling.min_tokens,
                                              sampling.include_stop_str_in_output)
            if matched is not None:
                self.stop_string = matched
                abort = True
            if self.placement is not None:
                self.timer.tokens(1, self.placement[0])
        num_unsent = len(outputs) - self.num_sent
        if self.unsent_prompt_logprobs is not None or (
                num_unsent and self.stream.wants(num_unsent)):
            self.stream.put(self.unsent(False))
        return abort

    def unsent(self, finished: bool) -> RequestOutput:
        """What its stream has not been handed: tokens, their text, logprobs."""
        out = RequestOutput(self.request_id, self.output_token_ids[self.num_sent:],
                            self.detokenizer.take_delta(finished), self.unsent_logprobs,
                            prompt_logprobs=self.unsent_prompt_logprobs)
        self.num_sent = len(self.output_token_ids)
        self.unsent_logprobs = []
        self.unsent_prompt_logprobs = None
        return out

    def finish(self, reason: FinishReason, stop_reason: str | int | None,
               fin: Finished | None) -> None:
        """Its last output, with its ending and usage counts (the engine core's `fin`)."""
        self.done = True
        out = self.unsent(True)
        out.finish_reason, out.stop_reason = reason, stop_reason
        out.num_prompt_tokens = len(self.prompt_token_ids)
        out.num_output_tokens = len(self.output_token_ids)
        if fin is not None:
            out.num_cached_tokens = fin.num_cached_tokens
            out.num_store_loaded_tokens = fin.num_store_loaded_tokens
        self.timer.finished(reason.value, out.num_prompt_tokens, out.num_output_tokens,
                            self.sampling.max_tokens, None if fin is None else fin.timing,
                            None if self.placement is None else self.placement[0])
        self.stream.put(out)

    def fail(self, error: str, server_fault: bool = False, invalid: bool = False) -> None:
        """It ends without finishing: `error` says why."""
        self.done = True
        self.timer.failed()
        self.stream.put(RequestOutput(self.request_id, [], "", [], FinishReason.ABORT,
                                      error=error, server_fault=server_fault,
                                      invalid=invalid))


class LiveRequests:
    def __init__(self) -> None:
        self._by_handle: dict[int, FrontRequest] = {}
        self._by_id: dict[str, FrontRequest] = {}
        self._num_on: Counter[Placement] = Counter()
        self._num_of: Counter[str] = Counter()     # live requests per client
        self.num_parked = 0
        self._next_handle = 1

    def __len__(self) -> int:
        return len(self._by_handle)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def new_handle(self) -> int:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        return handle

    def get(self, handle: int) -> FrontRequest | None:
        return self._by_handle.get(handle)

    def by_id(self, request_id: str) -> FrontRequest | None:
        return self._by_id.get(request_id)

    def num_of(self, client: str) -> int:
        """Live requests of `client` (FrontRequest.client)."""
        return self._num_of[client]

    def add(self, request: FrontRequest) -> bool:
        """A new request, parked until placed; False if its id is taken."""
        if request.request_id in self._by_id:
            return False
        self._by_handle[request.handle] = request
        self._by_id[request.request_id] = request
        self._num_of[request.client] += 1
        self.num_parked += 1
        return True

    def remove(self, request: FrontRequest) -> None:
        if self._by_handle.pop(request.handle, None) is None:
            return
        del self._by_id[request.request_id]
        self._num_of[request.client] -= 1
        if not self._num_of[request.client]:
            del self._num_of[request.client]
        self._leave(request)

    def place(self, request: FrontRequest, placement: Placement) -> None:
        self._leave(request)
        request.placement = placement
        self._num_on[placement] += 1

    def park(self, request: FrontRequest) -> None:
        self._leave(request)
        self.num_parked += 1

    def _leave(self, request: FrontRequest) -> None:
        """Takes it off the count of where it is (parked, or an engine core)."""
        if request.placement is None:
            self.num_parked -= 1
        else:
            self._num_on[request.placement] -= 1
            if not self._num_on[request.placement]:
                del self._num_on[request.placement]
        request.placement = None

    def num_on(self, placement: Placement) -> int:
        """Live requests placed on an engine core: the router's measure of its load."""
        return self._num_on[placement]

    def parked(self) -> list[FrontRequest]:
        return [r for r in self._by_handle.values() if r.placement is None and not r.done]

    def placed_on(self, placement: Placement) -> list[FrontRequest]:
        return [r for r in self._by_handle.values() if r.placement == placement]

    def placements(self) -> set[Placement]:
        return set(self._num_on)

    # A step message, fanned out.

    def take_outputs(self, message: EngineOutputs, placement: Placement,
                     vocab_size: int) -> list[FrontRequest]:
        """One engine core's step message (it came from `placement`) for these requests:
        each live one placed there takes its share (`FrontRequest.take`). The requests a stop
        string ended, for the caller to abort on the engine core. A malformed message is
        dropped whole (logged)."""
        try:
            handles_array = unpack_ints(message.handles, "<i8", message.num_rows, "handles")
            tokens_array = unpack_ints(message.token_ids, "<i4", message.num_rows, "token_ids")
        except ValueError as exc:
            log.warning("dropping a malformed step message from replica %d: %s",
                        message.replica_id, exc)
            return []
        if message.num_rows and (int(tokens_array.min()) < 0
                                 or int(tokens_array.max()) >= vocab_size):
            log.warning("dropping a step message with tokens outside the vocabulary from "
                        "replica %d", message.replica_id)
            return []
        handles, token_ids = handles_array.tolist(), tokens_array.tolist()
        aborts = []
        if not (message.finished or message.logprobs or message.prompt_logprobs
                or len(set(handles)) != len(handles)):
            # A plain decode step: one token for each request it names.
            by_handle = self._by_handle
            for handle, token_id in zip(handles, token_ids):
                request = by_handle.get(handle)
                if (request is not None and not request.done
                        and request.placement == placement
                        and request.take_token(token_id)):
                    aborts.append(request)
            return aborts
        # Endings, logprobs or several rows of one request.
        logprobs = {r.row: r.logprobs for r in message.logprobs}
        finished = {f.handle: f for f in message.finished}
        prompt_logprobs = {p.handle: p for p in message.prompt_logprobs}
        rows: dict[int, list[int]] = {}
        for row, handle in enumerate(handles):
            rows.setdefault(handle, []).append(row)
        for handle in rows.keys() | finished.keys():
            request = self._by_handle.get(handle)
            if request is None or request.done or request.placement != placement:
                continue      # cancelled, or moved off that engine core: a stale output
            mine = rows.get(handle, ())
            if request.take([token_ids[row] for row in mine],
                            [logprobs.get(row) for row in mine], finished.get(handle),
                            prompt_logprobs.get(handle)):
                aborts.append(request)
        return aborts
