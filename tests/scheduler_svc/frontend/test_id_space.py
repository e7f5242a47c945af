"""Each API key's own request ids (scheduler_svc.frontend.id_space, as the servicer uses it):
two keys run the same client id at once, each with its own stream and tokens, every response
naming the client's id; an Abort sees only the caller's request; a key's own live id is still
refused to it, naming the client's id; without keys ids are used as they come. Driven
directly, no server."""

import asyncio
from pathlib import Path

import grpc
import pytest

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.id_space import TAG_LEN, internal_id, max_client_len
from scheduler_svc.frontend.servicer import GenerationServicer
from scheduler_svc.frontend.validation import MAX_CHOICE_SUFFIX
from services.api_keys import ApiKeys
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.wire import MAX_ID_LEN
from tests.scheduler_svc.frontend.fakes import (
    FakeEngineLinks,
    cluster_state,
    finished,
    replica,
    settle,
    step_message,
)
from tests.scheduler_svc.frontend.test_abort_owner import (
    OTHER_KEY,
    OWNER_KEY,
    KeyedContext,
    abort,
    generate,
)
from tests.scheduler_svc.grpc_context import Aborted

A = replica(0)
OWNER = ApiKeys([OWNER_KEY]).check(OWNER_KEY) or ""
OTHER = ApiKeys([OTHER_KEY]).check(OTHER_KEY) or ""


def keyed_servicer(frontend: Frontend, model_path: Path, keys: bool = True,
                   ) -> GenerationServicer:
    frontend.take_state(cluster_state(A))
    return GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig(),
                              keys=ApiKeys([OWNER_KEY, OTHER_KEY]) if keys else None)


def request(request_id: str, n: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=[5, 6]),
                              sampling=pb.SamplingParams(max_tokens=8, n=n))


async def stream(servicer: GenerationServicer, links: FakeEngineLinks, request_id: str,
                 key: str | None) -> "asyncio.Task[list[pb.GenerateResponse]]":
    """A live Generate made with `key`, once its engine request was sent."""
    before = len(links.requests())

    task = asyncio.ensure_future(generate(servicer, request(request_id), key))
    for _ in range(500):
        if len(links.requests()) > before:
            return task
        await asyncio.sleep(0.001)
    raise AssertionError("the request was never dispatched")


def test_the_internal_id_is_the_owners_tag_and_the_clients_id() -> None:
    assert internal_id(None, "x") == internal_id("", "x") == "x"
    assert internal_id(OWNER, "x") == f"{OWNER[:TAG_LEN]}/x"
    assert internal_id(OWNER, "x") != internal_id(OTHER, "x")
    assert OWNER_KEY not in internal_id(OWNER, "x")
    assert max_client_len(None) == MAX_ID_LEN
    assert max_client_len(OWNER) == MAX_ID_LEN - TAG_LEN - 1
    assert max_client_len(OWNER, 2) == MAX_ID_LEN - MAX_CHOICE_SUFFIX - TAG_LEN - 1


def test_two_keys_run_the_same_id_at_once_and_abort_only_their_own(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    servicer = keyed_servicer(frontend, model_path)

    async def run() -> None:
        mine = await stream(servicer, links, "same", OWNER_KEY)
        theirs = await stream(servicer, links, "same", OTHER_KEY)
        (_, sent_mine), (_, sent_theirs) = links.requests()
        assert frontend.num_live == 2 and sent_mine.handle != sent_theirs.handle
        assert sent_mine.request_id.startswith(internal_id(OWNER, "same"))
        assert sent_theirs.request_id.startswith(internal_id(OTHER, "same"))
        frontend.take_outputs(step_message(A, [(sent_mine.handle, 11),
                                               (sent_theirs.handle, 21)]))
        await settle()
        # The other key's Abort of "same" cancels its own request only.
        assert await abort(servicer, "same", OTHER_KEY) is True
        theirs_out = await asyncio.wait_for(theirs, 5)
        assert not mine.done() and frontend.num_live == 1
        frontend.take_outputs(step_message(A, [(sent_mine.handle, 12)],
                                           [finished(sent_mine.handle, "length", 2, 2)]))
        mine_out = await asyncio.wait_for(mine, 5)
        assert [t for m in mine_out for t in m.token_ids] == [11, 12]
        assert mine_out[-1].finish_reason == "length"
        assert [t for m in theirs_out for t in m.token_ids] == [21]
        assert theirs_out[-1].finish_reason == "abort"
        assert {m.request_id for m in mine_out + theirs_out} == {"same"}
        assert await abort(servicer, "same", OWNER_KEY) is False      # finished
    asyncio.run(run())


def test_a_keys_abort_leaves_another_keys_request_of_that_id_running(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    servicer = keyed_servicer(frontend, model_path)

    async def run() -> None:
        task = await stream(servicer, links, "only-mine", OWNER_KEY)
        assert await abort(servicer, "only-mine", OTHER_KEY) is False
        assert servicer.abort("only-mine") is False     # keys on: no owner sees nothing
        await settle()
        assert not task.done() and not links.aborts()
        assert await abort(servicer, "only-mine", OWNER_KEY) is True
        assert (await asyncio.wait_for(task, 5))[-1].finish_reason == "abort"
    asyncio.run(run())


def test_a_keys_own_live_id_is_refused_naming_the_clients_id(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    servicer = keyed_servicer(frontend, model_path)

    async def run() -> None:
        task = await stream(servicer, links, "dup", OWNER_KEY)
        with pytest.raises(Aborted) as refused:
            await servicer.GenerateOnce(request("dup"),
                                        KeyedContext(OWNER_KEY))  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details == "request_id 'dup' is already in use"
        assert await abort(servicer, "dup", OWNER_KEY) is True
        await asyncio.wait_for(task, 5)
    asyncio.run(run())


def test_a_keyed_response_names_the_clients_id_or_a_fresh_one(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    servicer = keyed_servicer(frontend, model_path)

    async def engine() -> None:
        while not links.requests():
            await asyncio.sleep(0.001)
        ((_, sent),) = links.requests()
        frontend.take_outputs(step_message(A, [(sent.handle, 7)],
                                           [finished(sent.handle, "length", 2, 1)]))

    async def once(request_id: str) -> pb.GenerateResponse:
        links.sent.clear()
        answer, _ = await asyncio.gather(
            servicer.GenerateOnce(request(request_id),
                                  KeyedContext(OWNER_KEY)),  # type: ignore[arg-type]
            engine())
        return answer

    async def run() -> None:
        named = await once("mine")
        assert (named.request_id, list(named.token_ids)) == ("mine", [7])
        fresh = await once("")
        assert len(fresh.request_id) == 32 and "/" not in fresh.request_id
    asyncio.run(run())


def test_a_keyed_id_too_long_is_refused_by_the_clients_limit(
        frontend: Frontend, model_path: Path) -> None:
    servicer = keyed_servicer(frontend, model_path)

    for n in (1, 2):
        limit = max_client_len(OWNER, n)
        with pytest.raises(Aborted) as refused:
            asyncio.run(generate(servicer, request("x" * (limit + 1), n), OWNER_KEY))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details.startswith(f"request_id longer than {limit} characters")
        assert OWNER[:TAG_LEN] not in refused.value.details


def test_without_keys_ids_are_as_they_come_and_a_live_one_is_refused(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    servicer = keyed_servicer(frontend, model_path, keys=False)

    async def run() -> None:
        task = await stream(servicer, links, "plain", None)
        ((_, sent),) = links.requests()
        assert sent.request_id.startswith("plain#")
        with pytest.raises(Aborted) as refused:
            await servicer.GenerateOnce(request("plain"), KeyedContext(None))  # type: ignore[arg-type]
        assert refused.value.details == "request_id 'plain' is already in use"
        assert await abort(servicer, "plain", None) is True
        assert (await asyncio.wait_for(task, 5))[-1].request_id == "plain"
    asyncio.run(run())
