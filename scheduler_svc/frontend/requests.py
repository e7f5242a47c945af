"""Every live request of one front end: its client-side state (prompt, the tokens its client
has, its detokenizer and stream) and where it runs (a replica's engine core, or none while it
is parked waiting for one).

The front end (core.py) adds a request when its stream opens and removes it when the stream
ends; it places, parks and moves it. The engine core holds the request's scheduling state;
what is here is enough to run it again anywhere: prompt + outputs so far (a lost replica's
requests move token-exact). Everything here runs on the front end's event loop: no locks.
"""

from collections import Counter
from dataclasses import dataclass, field

from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer
from scheduler_svc.frontend.grammar import CompiledGrammar
from scheduler_svc.frontend.metrics import RequestTimer
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.streams import OutputStream
from services.wire import TokenLogprobs

Placement = tuple[int, int]        # (replica id, engine core epoch)


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


class LiveRequests:
    def __init__(self) -> None:
        self._by_handle: dict[int, FrontRequest] = {}
        self._by_id: dict[str, FrontRequest] = {}
        self._num_on: Counter[Placement] = Counter()
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

    def add(self, request: FrontRequest) -> bool:
        """A new request, parked until placed; False if its id is taken."""
        if request.request_id in self._by_id:
            return False
        self._by_handle[request.handle] = request
        self._by_id[request.request_id] = request
        self.num_parked += 1
        return True

    def remove(self, request: FrontRequest) -> None:
        if self._by_handle.pop(request.handle, None) is None:
            return
        del self._by_id[request.request_id]
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
