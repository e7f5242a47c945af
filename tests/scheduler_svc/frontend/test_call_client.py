"""Whose call a request is (scheduler_svc.frontend.call_client), as it reaches the
engine core in `EngineRequest.client` for its turn in the waiting queue: the declared
`splitserve-client` metadata first (bounded: INVALID_ARGUMENT naming the key; with API keys
a name within the key's owner), else the key's owner, else the peer's address with its port
(a connection); every choice of an n > 1 request is the same client, and a request moved off a lost
replica stays its client's. Driven directly, no server."""

import asyncio
from pathlib import Path

import grpc
import pytest

from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.wire import MAX_CLIENT_LEN, EngineRequest
from scheduler_svc.frontend.call_client import call_client
from scheduler_svc.frontend.core import Frontend
from scheduler_svc.frontend.servicer import GenerationServicer
from scheduler_svc.frontend.validation import InvalidRequest
from services.api_keys import (
    CLIENT_METADATA_KEY,
    MAX_DECLARED_CLIENT_LEN,
    ApiKeys,
    call_metadata,
)
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import generation_pb2 as pb
from tests.scheduler_svc.frontend.fakes import (
    FakeEngineLinks,
    cluster_state,
    placement_of,
    replica,
    settle,
    step_message,
)
from tests.scheduler_svc.grpc_context import Aborted, FakeContext

KEY = "tenant-key-0001"
PEER = "ipv4:10.1.2.3:50123"


class CallContext(FakeContext):
    """A call from `peer` with `metadata`."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), peer: str = PEER) -> None:
        self.metadata = metadata
        self.from_peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return self.from_peer

    async def write(self, message: pb.GenerateResponse) -> None:
        pass


def declaring(client: str) -> tuple[tuple[str, str], ...]:
    return (("user-agent", "grpc"), (CLIENT_METADATA_KEY, client))


def test_call_client_prefers_the_declared_then_the_owner_then_the_peer() -> None:
    owner = "ab" * 32
    assert call_client(declaring("tenant-a"), None, PEER) == "tenant-a"
    assert call_client(declaring("tenant-a"), owner, PEER) == "abababababababab/tenant-a"
    assert call_client((), owner, PEER) == owner
    assert call_client(None, None, PEER) == call_client(declaring(""), None, PEER) == PEER
    assert call_client((), None, "ipv6:[::1]:443") == "ipv6:[::1]:443"
    assert call_client((), None, "unix:/run/s.sock") == "unix:/run/s.sock"
    assert call_client((), None, "unix:/" + "x" * 300) == ("unix:/" + "x" * 300)[:MAX_CLIENT_LEN]
    longest = "c" * MAX_DECLARED_CLIENT_LEN
    assert call_client(declaring(longest), owner, PEER) == f"{owner[:16]}/{longest}"
    assert len(call_client(declaring(longest), owner, PEER)) <= MAX_CLIENT_LEN
    with pytest.raises(InvalidRequest, match=f"'{CLIENT_METADATA_KEY}' is 129 characters"):
        call_client(declaring(longest + "c"), None, PEER)


async def dispatched(servicer: GenerationServicer, frontend: Frontend, links: FakeEngineLinks,
                     context: CallContext, n: int = 1) -> list[EngineRequest]:
    """The EngineRequests one Generate call sends (every choice's: each after the one
    before made its first token); the call is cancelled afterwards."""
    entry = replica(0)
    frontend.take_state(cluster_state(entry))
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                 sampling=pb.SamplingParams(max_tokens=8, n=n))
    task = asyncio.ensure_future(servicer.Generate(request, context))  # type: ignore[arg-type]
    try:
        for _ in range(n):
            num_before = len(links.requests())
            for _ in range(500):
                if len(links.requests()) > num_before or task.done():
                    break
                await asyncio.sleep(0.001)
            if task.done():
                task.result()                       # raises what the call raised
            handle = links.requests()[-1][1].handle
            frontend.take_outputs(step_message(entry, [(handle, 7)]))
            await settle()
        return [m for _, m in links.requests()]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def servicer_for(frontend: Frontend, model_path: Path, keys: ApiKeys | None = None,
                 ) -> GenerationServicer:
    return GenerationServicer(frontend, load_model_config(model_path), SchedulerConfig(),
                              keys=keys)


def test_a_declared_client_reaches_the_engine_for_every_choice(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    context = CallContext(((CLIENT_METADATA_KEY, "tenant-a"),))
    sent = asyncio.run(dispatched(servicer_for(frontend, model_path), frontend, links,
                                  context, n=3))
    choices = sorted(m.request_id.split("#")[0].rsplit("-", 1)[1] for m in sent)
    assert choices == ["0", "1", "2"]
    assert [m.client for m in sent] == ["tenant-a"] * 3


def test_without_a_declared_client_the_connection_is_the_client(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    sent = asyncio.run(dispatched(servicer_for(frontend, model_path), frontend, links,
                                  CallContext()))
    assert [m.client for m in sent] == [PEER]


def test_with_keys_the_owner_is_the_client_and_names_a_declared_one(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    keys = ApiKeys([KEY])
    servicer = servicer_for(frontend, model_path, keys)
    sent = asyncio.run(dispatched(servicer, frontend, links, CallContext(call_metadata(KEY))))
    assert [m.client for m in sent] == [keys.owner(KEY)]
    declared = CallContext((*call_metadata(KEY), (CLIENT_METADATA_KEY, "tenant-b")))
    sent = asyncio.run(dispatched(servicer, frontend, links, declared))
    assert sent[-1].client == f"{keys.owner(KEY)[:16]}/tenant-b"


def test_a_declared_client_too_long_is_invalid_and_sent_nowhere(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    context = CallContext(((CLIENT_METADATA_KEY, "x" * (MAX_DECLARED_CLIENT_LEN + 1)),))
    with pytest.raises(Aborted) as exc:
        asyncio.run(dispatched(servicer_for(frontend, model_path), frontend, links, context))
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert CLIENT_METADATA_KEY in exc.value.details
    assert not links.requests()


def test_a_request_moved_off_a_lost_replica_keeps_its_client(
        frontend: Frontend, links: FakeEngineLinks, model_path: Path) -> None:
    servicer = servicer_for(frontend, model_path)
    a, b = replica(0), replica(1)

    async def run() -> list[EngineRequest]:
        frontend.take_state(cluster_state(a))
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                                     sampling=pb.SamplingParams(max_tokens=8))
        context = CallContext(((CLIENT_METADATA_KEY, "tenant-c"),))
        task = asyncio.ensure_future(servicer.Generate(request, context))  # type: ignore[arg-type]
        try:
            for _ in range(500):
                if links.requests():
                    break
                await asyncio.sleep(0.001)
            frontend.take_state(cluster_state(b, gone=[placement_of(a)]))
            for _ in range(500):
                if len(links.requests()) == 2:
                    break
                await asyncio.sleep(0.001)
            return [m for _, m in links.requests()]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    first, moved = asyncio.run(run())
    assert moved.handle == first.handle and moved.client == first.client == "tenant-c"
    assert [p for p, _ in links.requests()] == [placement_of(a), placement_of(b)]
