"""The public port's API-key check (scheduler_svc.frontend.auth) on a real grpc.aio server:
calls without a key or with a wrong one are UNAUTHENTICATED before the servicer runs (whatever
the method's shape, even a request that does not parse), the message says which and never
echoes the key; a configured key reaches the servicer; health checks stay open; and the same
over TLS (services.tls), which a plaintext client cannot use."""

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scheduler_svc.frontend.auth import ApiKeyInterceptor
from services import tls
from services.api_keys import INVALID, MISSING, ApiKeys, call_metadata
from services.grpc_server import Health, bind, make_server
from services.rpc.splitserve.v1 import generation_pb2 as pb
from services.rpc.splitserve.v1 import generation_pb2_grpc
from tests.services.tls_files import self_signed

KEYS = ("key-one-0123", "key-two-4567")


class EchoServicer(generation_pb2_grpc.GenerationServicer):
    """Counts the calls that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request: pb.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        yield pb.GenerateResponse(text=request.text)

    async def Tokenize(self, request: pb.TokenizeRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self.calls += 1
        return pb.TokenizeResponse(prompt=request.text)


Test = Callable[[grpc.aio.Channel, EchoServicer], Coroutine[Any, Any, None]]


def serve(test: Test, credentials: grpc.ServerCredentials | None = None,
          channel: Callable[[str], grpc.aio.Channel] | None = None) -> None:
    async def main() -> None:
        servicer = EchoServicer()
        server = make_server(first=[ApiKeyInterceptor(ApiKeys(KEYS))])
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        health = Health(server, ["splitserve.v1.Generation"])
        port = bind(server, "127.0.0.1", 0, credentials)
        await server.start()
        await health.set_live()
        try:
            address = f"127.0.0.1:{port}"
            async with (channel or grpc.aio.insecure_channel)(address) as open_channel:
                await test(open_channel, servicer)
        finally:
            await server.stop(None)
    asyncio.run(main())


async def refused(call: Coroutine[Any, Any, Any] | Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if isinstance(call, grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall):
            [_ async for _ in call]
        else:
            await call
    return info.value


def test_calls_without_a_configured_key_never_reach_the_servicer() -> None:
    async def test(channel: grpc.aio.Channel, servicer: EchoServicer) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        wrong = [("authorization", "Bearer key-one-012"), ("authorization", "key-one-0123"),
                 ("authorization", "Basic key-one-0123"), ("x-api-key", KEYS[0])]
        for metadata, why in [(None, MISSING), *((m, MISSING if "Bearer" not in m[1]
                                                  else INVALID) for m in wrong)]:
            md = None if metadata is None else (metadata,)
            for call in (stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=md, timeout=5),
                         stub.Generate(pb.GenerateRequest(text="x"), metadata=md, timeout=5)):
                error = await refused(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
                assert error.details() == why
                assert KEYS[0][:7] not in (error.details() or "")
        # A request that does not even parse: refused for its key, not for its bytes.
        raw = channel.unary_unary("/splitserve.v1.Generation/Tokenize")
        error = await refused(raw(b"\xff\xff\xff", timeout=5))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        # Reflection (the API's schema) needs a key too.
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        error = await refused(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert servicer.calls == 0
    serve(test)


def test_a_configured_key_reaches_the_servicer_and_health_is_open() -> None:
    async def test(channel: grpc.aio.Channel, servicer: EchoServicer) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for key in KEYS:
            reply = await stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=5,
                                        metadata=call_metadata(key))
            assert reply.prompt == "hi"
            [out] = [m async for m in stub.Generate(pb.GenerateRequest(text="yo"), timeout=5,
                                                    metadata=call_metadata(key))]
            assert out.text == "yo"
        # The scheme is case-insensitive, as HTTP's.
        await stub.Tokenize(pb.TokenizeRequest(), timeout=5,
                            metadata=(("authorization", f"bearer {KEYS[1]}"),))
        assert servicer.calls == 5
        health = health_pb2_grpc.HealthStub(channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    serve(test)


def test_the_interceptor_needs_keys() -> None:
    with pytest.raises(ValueError, match="at least one key"):
        ApiKeyInterceptor(ApiKeys())


def test_tls_with_keys(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    credentials = tls.server_credentials(str(cert), str(key))

    def secure(address: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, tls.channel_credentials(str(cert)))

    async def test(channel: grpc.aio.Channel, servicer: EchoServicer) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply = await stub.Tokenize(pb.TokenizeRequest(text="tls"), timeout=5,
                                    metadata=call_metadata(KEYS[0]))
        assert reply.prompt == "tls"
        error = await refused(stub.Tokenize(pb.TokenizeRequest(), timeout=5))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED

    serve(test, credentials, secure)

    async def plaintext(channel: grpc.aio.Channel, servicer: EchoServicer) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        error = await refused(stub.Tokenize(pb.TokenizeRequest(), timeout=3,
                                            metadata=call_metadata(KEYS[0])))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls == 0

    serve(plaintext, credentials)


def test_the_schedulers_flags_reach_the_front_ends(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler_svc.__main__ import parse_args
    from scheduler_svc.cluster.wire import FrontendLaunch
    from services.codec import Codec

    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SPLITSERVE_API_KEY", "env-key-1,env-key-2")
    settings = parse_args(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert settings.server.api_keys == ("env-key-1", "env-key-2")
    assert "env-key-1" not in repr(settings.server)
    launch = FrontendLaunch(index=0, parent_pid=1, server=settings.server,
                            scheduler=settings.scheduler, served_name="m",
                            query_address="tcp://127.0.0.1:1")
    codec = Codec(FrontendLaunch)
    server = codec.decode(codec.encode(launch)).server
    assert (server.api_keys, server.ssl_certfile, server.ssl_keyfile) == (
        ("env-key-1", "env-key-2"), str(cert), str(key))
    settings = parse_args(["--api-key", "flag-key"])
    assert settings.server.api_keys == ("flag-key",) and settings.server.ssl_certfile is None
    with pytest.raises(SystemExit):
        parse_args(["--ssl-certfile", str(cert)])
