"""Fakes and builders for the front end's unit tests: engine links that record what the front
end sends, the cluster's state and engine cores' step messages built by hand (packed as the
engine packs them), live requests, and a client that consumes `Frontend.generate` on the loop.
No sockets besides the router's."""

import asyncio
from collections.abc import Iterable, Sequence

import zmq

from scheduler_svc.cluster.wire import ClusterState, ReplicaEntry
from scheduler_svc.engine.wire import (
    EngineAbort,
    EngineOutputs,
    EngineRequest,
    Finished,
    GrammarVocabulary,
    RowLogprobs,
    ToEngine,
    engine_request_id,
    pack_ints,
)
from scheduler_svc.frontend.core import Frontend, ModelFacts
from scheduler_svc.frontend.detokenizer import IncrementalDetokenizer
from scheduler_svc.frontend.metrics import RequestTimer
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest
from scheduler_svc.frontend.requests import FrontRequest, Placement
from scheduler_svc.frontend.router import Router
from scheduler_svc.frontend.streams import OutputStream, RequestOutput
from scheduler_svc.frontend.tokenizer import TextTokenizer
from scheduler_svc.frontend.validation import Limits
from services.wire import TokenLogprobs

EOS = 2                          # the default model's <|im_end|>
ENGINE_EPOCH = 1_000             # the first engine core instance of every replica here
UNREACHABLE_KVCACHE = "tcp://127.0.0.1:9"   # the router's prefix queries get no answer


class FakeEngineLinks:
    """Stands in for `links.EngineLinks`: records every message per engine core."""

    def __init__(self, epoch: int = 7) -> None:
        self.epoch = epoch
        self.sent: list[tuple[Placement, str, ToEngine]] = []
        self.vocabularies: list[Placement] = []
        self.forgotten: list[Placement] = []
        self._known: dict[Placement, str] = {}

    def send(self, placement: Placement, address: str, message: ToEngine) -> None:
        self._known[placement] = address
        self.sent.append((placement, address, message))

    def send_known(self, placement: Placement, message: ToEngine) -> bool:
        address = self._known.get(placement)
        if address is None:
            return False
        self.sent.append((placement, address, message))
        return True

    def send_vocabulary(self, placement: Placement, address: str, vocabulary: bytes) -> None:
        """Once per engine core, as EngineLinks does."""
        if placement not in self.vocabularies:
            self.vocabularies.append(placement)
            self.send(placement, address, GrammarVocabulary(vocabulary=vocabulary))

    def forget(self, placement: Placement) -> None:
        self._known.pop(placement, None)
        self.forgotten.append(placement)

    def known(self) -> set[Placement]:
        return set(self._known)

    def requests(self) -> list[tuple[Placement, EngineRequest]]:
        """Every EngineRequest sent, with where it went."""
        return [(p, m) for p, _, m in self.sent if isinstance(m, EngineRequest)]

    def aborts(self) -> list[tuple[Placement, list[str]]]:
        return [(p, m.request_ids) for p, _, m in self.sent if isinstance(m, EngineAbort)]


def replica(replica_id: int, engine_epoch: int = ENGINE_EPOCH,
            num_kv_blocks: int = 1024) -> ReplicaEntry:
    return ReplicaEntry(replica_id=replica_id, engine_epoch=engine_epoch,
                        address=f"tcp://127.0.0.1:{40000 + replica_id}",
                        num_kv_blocks=num_kv_blocks)


def placement_of(entry: ReplicaEntry) -> Placement:
    return (entry.replica_id, entry.engine_epoch)


def cluster_state(*ready: ReplicaEntry, gone: Iterable[Placement] = (),
                  kv_reachable: bool = True, draining: bool = False,
                  max_kv_tokens: int | None = None) -> ClusterState:
    return ClusterState(seq=0, ready=list(ready), kv_reachable=kv_reachable, draining=draining,
                        max_kv_tokens=max_kv_tokens, served_dtype="float32", gone=list(gone))


def finished(handle: int, reason: str = "stop", num_prompt_tokens: int = 0,
             num_output_tokens: int = 0, stop_token_id: int | None = None,
             num_cached_tokens: int = 0, num_store_loaded_tokens: int = 0,
             error: str | None = None, server_fault: bool = False,
             invalid: bool = False) -> Finished:
    return Finished(handle=handle, reason=reason, stop_token_id=stop_token_id,
                    num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                    num_cached_tokens=num_cached_tokens,
                    num_store_loaded_tokens=num_store_loaded_tokens, error=error,
                    server_fault=server_fault, invalid=invalid)


def step_message(entry: ReplicaEntry | Placement, rows: Sequence[tuple[int, int]] = (),
                 finished: Sequence[Finished] = (), down: str | None = None,
                 logprobs: dict[int, TokenLogprobs] | None = None) -> EngineOutputs:
    """What an engine core sends for one step: `rows` are (handle, token id), packed as
    engine.outputs packs them; `logprobs`: row index -> its logprobs."""
    replica_id, epoch = entry if isinstance(entry, tuple) else placement_of(entry)
    return EngineOutputs(
        replica_id=replica_id, engine_epoch=epoch, num_rows=len(rows),
        handles=pack_ints([h for h, _ in rows], "<i8"),
        token_ids=pack_ints([t for _, t in rows], "<i4"), finished=list(finished),
        logprobs=[RowLogprobs(row, lp) for row, lp in (logprobs or {}).items()], down=down)


def front_request(tokenizer: TextTokenizer, request_id: str, prompt: Sequence[int],
                  handle: int = 1, deadline: float = 1e12, cache_salt: bytes = b"",
                  **sampling: object) -> FrontRequest:
    """A live request as `Frontend.make_request` builds it (no metrics)."""
    params = SamplingParams(**sampling)  # type: ignore[arg-type]
    return FrontRequest(
        request_id=request_id, handle=handle,
        engine_id=engine_request_id(request_id, 0, handle), prompt_token_ids=list(prompt),
        sampling=params, cache_salt=cache_salt, grammar=None, stream=OutputStream(),
        detokenizer=IncrementalDetokenizer(tokenizer.tokenizer, prompt,
                                           params.skip_special_tokens, params.stop),
        timer=RequestTimer(None), deadline=deadline)


def make_router(ctx: zmq.Context, prefix_caching: bool = False, block_size: int = 16,
                route_tokens_per_request: float = 64.0) -> Router:
    """A real router whose kvcache_svc never answers (prefix caching off: never asked)."""
    return Router(ctx, UNREACHABLE_KVCACHE, block_size, prefix_caching,
                  route_tokens_per_request)


def replace_kvcache(router: Router, client: object) -> None:
    """The router's kvcache_svc client swapped for a fake with `call` and `close` (the real
    one closed first: the test's context must end with no socket open)."""
    router._client.close()
    router._client = client  # type: ignore[assignment]


def make_frontend(tokenizer: object, limits: Limits, router: Router | None = None,
                  links: FakeEngineLinks | None = None, max_live_requests: int = 8,
                  replica_wait_s: float = 60.0, eos_token_ids: tuple[int, ...] = (EOS,),
                  **kw: object) -> Frontend:
    """A front end with no sockets of its own. Without a router, only its prompt path (and
    nothing that dispatches) may be used."""
    return Frontend(0, tokenizer, limits,  # type: ignore[arg-type]
                    ModelFacts(eos_token_ids, limits.vocab_size),
                    router, links or FakeEngineLinks(),  # type: ignore[arg-type]
                    max_live_requests=max_live_requests, replica_wait_s=replica_wait_s,
                    **kw)  # type: ignore[arg-type]


class Client:
    """A client's stream: consumes `frontend.generate(prepared)` on the running loop."""

    def __init__(self, frontend: Frontend, prepared: PreparedRequest,
                 time_remaining: float | None = None, whole: bool = False) -> None:
        self.outputs: list[RequestOutput] = []
        self.error: Exception | None = None
        self.task = asyncio.ensure_future(self._consume(frontend, prepared, time_remaining,
                                                        whole))

    async def _consume(self, frontend: Frontend, prepared: PreparedRequest,
                       time_remaining: float | None, whole: bool) -> None:
        try:
            async for out in frontend.generate(prepared, time_remaining, whole):
                self.outputs.append(out)
        except Exception as exc:  # what the servicer would turn into a status
            self.error = exc

    @property
    def done(self) -> bool:
        return self.task.done()

    @property
    def token_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.new_token_ids]

    @property
    def text(self) -> str:
        return "".join(out.text for out in self.outputs)

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]


async def settle(turns: int = 10) -> None:
    """Lets the loop run what is ready (dispatch tasks, the client's stream)."""
    for _ in range(turns):
        await asyncio.sleep(0)
