"""Abort with API keys (scheduler_svc.frontend.servicer): only the key that made a request may
cancel it; another key's Abort answers found=false, as for an id nobody uses, and leaves the
request running; the other front ends get the asker's owner with the relayed query and apply
the same rule; without keys any Abort cancels, as before. Driven directly, no server. (Each
key's own id space: test_id_space.py.)"""

import asyncio
from pathlib import Path

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.servicer import GenerationServicer
from services.api_keys import ApiKeys, call_metadata
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.scheduler_svc.frontend.fakes import FakeEngineLinks, cluster_state, replica, settle
from tests.scheduler_svc.frontend.test_servicer import FakeClusterLink
from tests.scheduler_svc.grpc_context import FakeContext

OWNER_KEY, OTHER_KEY = "owner-key-0001", "other-key-0002"


class KeyedContext(FakeContext):
    """A call that presented `key` (the interceptor let it through)."""

    def __init__(self, key: str | None) -> None:
        self.metadata = call_metadata(key)
        self.written: list[pb.GenerateResponse] = []     # Generate's messages, in order

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def write(self, message: pb.GenerateResponse) -> None:
        self.written.append(message)


async def generate(servicer: GenerationServicer, request: pb.GenerateRequest,
                   key: str | None) -> list[pb.GenerateResponse]:
    """Every message a Generate made with `key` writes, once it returns."""
    context = KeyedContext(key)
    await servicer.Generate(request, context)  # type: ignore[arg-type]
    return context.written


async def start(servicer: GenerationServicer, frontend: Frontend, links: FakeEngineLinks,
                request_id: str, key: str | None) -> "asyncio.Task[list[pb.GenerateResponse]]":
    """A live Generate of `request_id`, dispatched to a replica, made with `key`."""
    frontend.take_state(cluster_state(replica(0)))
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=[5, 6]),
                                 sampling=pb.SamplingParams(max_tokens=8))

    task = asyncio.ensure_future(generate(servicer, request, key))
    for _ in range(200):
        if links.requests():
            break
        await asyncio.sleep(0.001)
    assert links.requests(), "the request was never dispatched"
    return task


async def abort(servicer: GenerationServicer, request_id: str, key: str | None) -> bool:
    answer = await servicer.Abort(pb.AbortRequest(request_id=request_id),
                                  KeyedContext(key))  # type: ignore[arg-type]
    return answer.found


def test_only_the_key_that_made_a_request_may_abort_it(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    link = FakeClusterLink()
    servicer = GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig(),
                                  link, num_frontends=2,  # type: ignore[arg-type]
                                  keys=ApiKeys([OWNER_KEY, OTHER_KEY]))

    async def run() -> None:
        task = await start(servicer, frontend, links, "r1", OWNER_KEY)
        assert await abort(servicer, "r1", OTHER_KEY) is False
        assert await abort(servicer, "nobody", OTHER_KEY) is False     # the same answer
        await settle()
        assert not task.done() and frontend.num_live == 1 and not links.aborts()
        # Relayed to the other front end with the asker's owner, a digest, never the key.
        owners = link.owners
        assert owners[0] == ApiKeys([OTHER_KEY]).check(OTHER_KEY) and OTHER_KEY not in owners[0]
        # Another front end asking for the wrong owner cancels nothing here either.
        assert link.on_abort("r1", owners[0]) is False  # type: ignore[attr-defined]
        assert frontend.num_live == 1
        assert await abort(servicer, "r1", OWNER_KEY) is True
        outputs = await asyncio.wait_for(task, 5)
        assert outputs[-1].finish_reason == "abort"
        assert links.aborts() and frontend.num_live == 0
    asyncio.run(run())


def test_an_owners_abort_relayed_from_another_front_end_cancels(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    keys = ApiKeys([OWNER_KEY])
    link = FakeClusterLink()
    servicer = GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig(),
                                  link, num_frontends=2, keys=keys)  # type: ignore[arg-type]

    async def run() -> None:
        task = await start(servicer, frontend, links, "r2", OWNER_KEY)
        owner = keys.check(OWNER_KEY)
        assert owner is not None
        assert link.on_abort("r2", owner) is True  # type: ignore[attr-defined]
        assert (await asyncio.wait_for(task, 5))[-1].finish_reason == "abort"
    asyncio.run(run())


def test_without_keys_any_abort_cancels(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    link = FakeClusterLink()
    servicer = GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig(),
                                  link, num_frontends=2)  # type: ignore[arg-type]

    async def run() -> None:
        task = await start(servicer, frontend, links, "r4", None)
        assert await abort(servicer, "r4", OTHER_KEY) is True
        assert (await asyncio.wait_for(task, 5))[-1].finish_reason == "abort"
        assert link.owners == [""]
    asyncio.run(run())
