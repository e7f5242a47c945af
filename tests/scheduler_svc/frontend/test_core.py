"""The front end's core, driven with no sockets (fake engine links, a real router whose
kvcache_svc never answers, the cluster's state and engine cores' step messages built by hand).

The prompt path: sizes and roles are checked before any tokenizing, and rendering plus
tokenizing run off the event loop (a long prompt once stalled every stream for seconds). A
request's start: it waits parked until a replica is ready (or fails at its deadline), goes to
an engine core as an EngineRequest (the grammar's vocabulary first), ends as an invalid one when
the engine core refuses it, and is aborted on its engine core when its client goes away.
Outputs and stop strings are test_core_outputs.py; moves off lost replicas test_core_moves.py."""

import asyncio
import time
from collections.abc import Sequence

import pytest

from scheduler_svc.engine.request import FinishReason
from scheduler_svc.engine.wire import EngineRequest, GrammarVocabulary, engine_request_id
from scheduler_svc.frontend.core import (
    Draining,
    Frontend,
    QueueFull,
    RequestFailed,
    calling_client,
)
from scheduler_svc.frontend.grammar import CompiledGrammar
from scheduler_svc.frontend.params import SamplingParams
from scheduler_svc.frontend.prompts import PreparedRequest, PromptInput
from scheduler_svc.frontend.structured_output import OutputKind, StructuredOutput
from scheduler_svc.frontend.tokenizer import ChatMessage, TextTokenizer
from scheduler_svc.frontend.validation import InvalidRequest, Limits, RawSampling
from tests.scheduler_svc.frontend.fakes import (
    Client,
    FakeEngineLinks,
    cluster_state,
    finished,
    make_frontend,
    placement_of,
    replica,
    settle,
    step_message,
)


class CountingTokenizer:
    """Stands in for a TextTokenizer and counts the work it is given."""

    chat_template = "x"

    def __init__(self) -> None:
        self.num_encoded = 0
        self.num_rendered = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.num_encoded += 1
        return [1] * len(text)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    tools: object = None, documents: object = None,
                    template_kwargs: object = None) -> str:
        self.num_rendered += 1
        return "".join(f"<{m.role}>{m.content}" for m in messages)


def prepared(request_id: str = "r", prompt: Sequence[int] = (5, 6, 7),
             **sampling: object) -> PreparedRequest:
    return PreparedRequest(request_id, list(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]


async def stop(client: Client) -> None:
    """The client goes away (its call is cancelled)."""
    client.task.cancel()
    await asyncio.gather(client.task, return_exceptions=True)


# ---------------------------------------------------------------- the prompt path


def test_oversized_text_is_refused_before_tokenizing() -> None:
    tokenizer = CountingTokenizer()
    frontend = make_frontend(tokenizer, Limits("m", 100, 50, max_prompt_bytes=1000))

    async def run() -> None:
        start = time.monotonic()
        with pytest.raises(InvalidRequest, match="prompt text is 15000000 bytes of UTF-8; this "
                                                 "server takes at most 1000 bytes"):
            await frontend.prepare("", "", PromptInput(text="x" * 15_000_000), RawSampling())
        assert time.monotonic() - start < 1.0
        with pytest.raises(InvalidRequest, match="chat content is 1001 bytes"):
            await frontend.prompts.render(PromptInput(chat=[ChatMessage("user", "y" * 1001)]))
        # A chat whose rendering outgrows the limit is refused before it is encoded.
        with pytest.raises(InvalidRequest, match="rendered chat is 1006 bytes"):
            await frontend.prompts.render(PromptInput(chat=[ChatMessage("user", "y" * 1000)]))
    asyncio.run(run())
    frontend.close()
    assert tokenizer.num_encoded == 0 and tokenizer.num_rendered == 1


def test_bad_role_is_refused_before_rendering() -> None:
    tokenizer = CountingTokenizer()
    frontend = make_frontend(tokenizer, Limits("m", 100, 50, max_prompt_bytes=1000))
    chat = [ChatMessage("user<|im_end|>", "hi")]
    with pytest.raises(InvalidRequest, match=r"role 'user<\|im_end\|>'; roles are system, user"):
        asyncio.run(frontend.prepare("", "", PromptInput(chat=chat), RawSampling()))
    frontend.close()
    assert tokenizer.num_rendered == 0


def test_tokenizing_leaves_the_event_loop_free(tokenizer: TextTokenizer) -> None:
    """While a ~1 MB prompt is tokenized (about a second of CPU), the loop still turns."""
    text = "The quick brown fox jumps over the lazy dog, 12345 times. " * 18_000
    frontend = make_frontend(tokenizer, Limits("m", tokenizer.vocab_size, 8192,
                                               max_prompt_bytes=2 << 20))
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - start - 0.005)

    async def run() -> float:
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        _, ids = await frontend.prompts.render(PromptInput(text=text))
        took = time.perf_counter() - start
        task.cancel()
        assert len(ids) > 100_000
        return took

    took = asyncio.run(run())
    frontend.close()
    assert took > 0.2, f"tokenizing took only {took:.2f}s: the prompt is too short to tell"
    assert max(lags) < took / 4, f"the loop stalled {max(lags):.2f}s of {took:.2f}s"


def test_the_smallest_pool_in_the_clusters_state_bounds_a_request(frontend: Frontend) -> None:
    async def run() -> None:
        frontend.take_state(cluster_state(replica(0), max_kv_tokens=64))
        with pytest.raises(InvalidRequest, match=r"needs more KV cache than a replica has "
                                                 r"\(64 tokens\)"):
            await frontend.prepare("r", "m", PromptInput(token_ids=[5] * 60),
                                   RawSampling(max_tokens=5))
        ok = await frontend.prepare("r", "m", PromptInput(token_ids=[5] * 60),
                                    RawSampling(max_tokens=4))
        assert ok.prompt_token_ids == [5] * 60 and ok.sampling.max_tokens == 4

    asyncio.run(run())


# ---------------------------------------------------------------- dispatch


def test_a_request_goes_to_its_engine_core_as_token_ids(frontend: Frontend,
                                                        links: FakeEngineLinks) -> None:
    a = replica(0)

    async def run() -> None:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, PreparedRequest(
            "r", [5, 6, 7], SamplingParams(temperature=0.5, seed=3, max_tokens=9, min_tokens=2,
                                           stop=("x",), stop_token_ids=(77,), ignore_eos=True),
            cache_salt=b"tenant"))
        await settle()
        ((where, address, sent),) = links.sent
        assert (where, address) == (placement_of(a), a.address)
        assert isinstance(sent, EngineRequest)
        assert sent.request_id == engine_request_id("r", 0, sent.handle)
        assert (sent.frontend, sent.token_ids, sent.num_prompt_tokens) == (0, [5, 6, 7], 3)
        assert (sent.max_tokens, sent.min_tokens, sent.stop_token_ids, sent.ignore_eos) == (
            9, 2, [77], True)
        assert (sent.sampling.temperature, sent.sampling.seed) == (0.5, 3)
        assert sent.cache_salt == b"tenant" and sent.grammar is None
        assert frontend.live.num_on(placement_of(a)) == 1 and frontend.live.num_parked == 0
        await stop(client)

    asyncio.run(run())


class FakeGrammars:
    def vocabulary(self) -> bytes:
        return b'{"vocabulary": "serialized"}'


def test_a_grammar_follows_its_vocabulary_once_per_engine_core(frontend: Frontend,
                                                                links: FakeEngineLinks) -> None:
    frontend.grammars = FakeGrammars()  # type: ignore[assignment]
    grammar = CompiledGrammar(StructuredOutput(OutputKind.REGEX, "[0-9]+"), b'{"grammar": 1}')
    a = replica(0)

    async def run() -> None:
        frontend.take_state(cluster_state(a))
        clients = [Client(frontend, PreparedRequest(f"r{i}", [5, 6], SamplingParams(),
                                                    grammar=grammar)) for i in range(2)]
        await settle()
        messages = [m for _, _, m in links.sent]
        assert [type(m) for m in messages] == [GrammarVocabulary, EngineRequest, EngineRequest]
        assert messages[0] == GrammarVocabulary(FakeGrammars().vocabulary())
        assert all(m.grammar == b'{"grammar": 1}' for m in messages[1:])  # type: ignore[union-attr]
        for client in clients:
            await stop(client)

    asyncio.run(run())


def test_a_parked_request_waits_for_a_ready_replica(frontend: Frontend,
                                                    links: FakeEngineLinks) -> None:
    a = replica(0)

    async def run() -> None:
        client = Client(frontend, prepared())      # no state heard yet: parked
        await settle()
        frontend.take_state(cluster_state())       # nothing ready: still parked
        await settle()
        assert links.sent == [] and frontend.live.num_parked == 1
        assert frontend.report().num_parked == 1 and not frontend.ready
        frontend.take_state(cluster_state(a))
        await settle()
        assert [where for where, _ in links.requests()] == [placement_of(a)]
        assert frontend.live.num_parked == 0 and frontend.ready
        await stop(client)

    asyncio.run(run())


@pytest.mark.parametrize("replica_wait_s, time_remaining", [(0.05, None), (60.0, 0.55)])
def test_a_parked_request_fails_at_its_deadline(frontend: Frontend, links: FakeEngineLinks,
                                                replica_wait_s: float,
                                                time_remaining: float | None) -> None:
    """The front end's wait for a replica, or the client's deadline less half a second,
    whichever comes first."""
    frontend.replica_wait_s = replica_wait_s

    async def run() -> Client:
        client = Client(frontend, prepared(), time_remaining)
        await settle()
        frontend.take_state(cluster_state())
        await settle()
        assert not client.done                     # not yet
        await asyncio.sleep(0.1)
        frontend.take_state(cluster_state())
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert isinstance(client.error, RequestFailed) and not client.error.server_fault
    assert "no replica became ready before the request's deadline" in str(client.error)
    assert links.sent == [] and frontend.num_live == 0


@pytest.mark.parametrize("server_fault, invalid, error_type", [
    (False, True, InvalidRequest), (True, False, RequestFailed)])
def test_an_engine_cores_refusal_or_failure_ends_the_call(
        frontend: Frontend, links: FakeEngineLinks, server_fault: bool, invalid: bool,
        error_type: type[Exception]) -> None:
    """A request the replica can never run (longer than its pool) is the client's error
    (INVALID_ARGUMENT); a failed step is the server's (INTERNAL)."""
    a = replica(0)

    async def run() -> Client:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, prepared(max_tokens=4))
        await settle()
        ((_, sent),) = links.requests()
        frontend.take_outputs(step_message(a, finished=[finished(
            sent.handle, "abort", error="the pool holds 16 tokens", server_fault=server_fault,
            invalid=invalid)]))
        await asyncio.wait_for(client.task, 5)
        return client

    client = asyncio.run(run())
    assert type(client.error) is error_type and "the pool holds 16 tokens" in str(client.error)
    if isinstance(client.error, RequestFailed):
        assert client.error.server_fault
    assert client.outputs == [] and frontend.num_live == 0
    assert links.aborts() == []        # the engine core ended it itself


def test_a_client_that_goes_away_aborts_its_request_on_its_engine_core(
        frontend: Frontend, links: FakeEngineLinks) -> None:
    a = replica(0)

    async def run() -> None:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, prepared())
        await settle()
        ((_, sent),) = links.requests()
        await stop(client)
        assert links.aborts() == [(placement_of(a), [sent.request_id])]
        assert frontend.num_live == 0 and frontend.live.num_on(placement_of(a)) == 0

    asyncio.run(run())


def test_cancel_by_id_aborts_a_placed_request_and_ends_a_parked_one(
        frontend: Frontend, links: FakeEngineLinks) -> None:
    a = replica(0)

    async def run() -> tuple[Client, Client]:
        parked = Client(frontend, prepared("parked"))      # no replica yet
        await settle()
        assert frontend.cancel_id("parked") and not frontend.cancel_id("nobody")
        await asyncio.wait_for(parked.task, 5)
        assert links.sent == []                            # nothing runs it: nothing to abort
        frontend.take_state(cluster_state(a))
        placed = Client(frontend, prepared("placed"))
        await settle()
        assert frontend.cancel_id("placed")
        await asyncio.wait_for(placed.task, 5)
        return placed, parked

    placed, parked = asyncio.run(run())
    ((_, sent),) = links.requests()
    assert links.aborts() == [(placement_of(a), [sent.request_id])]
    for client in (placed, parked):
        assert client.error is None
        assert [(o.finish_reason, o.new_token_ids) for o in client.outputs] == [
            (FinishReason.ABORT, [])]
    assert frontend.num_live == 0


def test_a_cancel_reaches_an_engine_core_that_left_the_ready_list(
        frontend: Frontend, links: FakeEngineLinks) -> None:
    """An engine core whose pool kvcache_svc is re-creating is out of the cluster's ready
    list (no new requests) but keeps its running requests: a cancel must still stop it
    computing for a client that is gone."""
    a = replica(0)

    async def run() -> None:
        frontend.take_state(cluster_state(a))
        client = Client(frontend, prepared())
        await settle()
        frontend.take_state(cluster_state())       # a's kv_ok went false; not gone
        await stop(client)

    asyncio.run(run())
    ((_, sent),) = links.requests()
    assert links.aborts() == [(placement_of(a), [sent.request_id])]


def test_draining_full_and_duplicate_requests_are_refused(frontend: Frontend) -> None:
    frontend.max_live_requests = 1

    async def run() -> None:
        frontend.take_state(cluster_state(replica(0)))
        first = Client(frontend, prepared("r"))
        await settle()
        with pytest.raises(QueueFull, match="1 requests are live"):
            await anext(frontend.generate(prepared("other")))
        frontend.max_live_requests = 2
        with pytest.raises(InvalidRequest, match="'r' is already in use"):
            await anext(frontend.generate(prepared("r")))
        frontend.take_state(cluster_state(replica(0), draining=True))   # the cluster drains
        with pytest.raises(Draining):
            await anext(frontend.generate(prepared("other")))
        frontend.take_state(cluster_state(replica(0)))
        frontend.draining = True                                        # this front end does
        with pytest.raises(Draining):
            await anext(frontend.generate(prepared("other")))
        await stop(first)

    asyncio.run(run())
    assert frontend.report().num_requests_total == 1


def test_one_client_holds_at_most_its_share_of_the_live_requests(frontend: Frontend) -> None:
    frontend.max_live_requests = 4                 # one client may hold 3

    async def run() -> None:
        frontend.take_state(cluster_state(replica(0)))
        token = calling_client.set("flooder")
        flood = [Client(frontend, prepared(f"f{i}")) for i in range(3)]
        await settle()
        with pytest.raises(QueueFull, match=r"this client has 3 requests live, the most one "
                                            r"client may hold \(a front end holds 4, a "
                                            r"quarter kept for other clients\)"):
            await anext(frontend.generate(prepared("f3")))
        calling_client.reset(token)
        # The last quarter is another client's.
        token = calling_client.set("control")
        control = Client(frontend, prepared("c"))
        await settle()
        assert len(frontend.live) == 4 and frontend.live.num_of("control") == 1
        calling_client.reset(token)
        await stop(control)
        for client in flood:
            await stop(client)
        assert frontend.live.num_of("flooder") == 0 and len(frontend.live) == 0

    asyncio.run(run())
