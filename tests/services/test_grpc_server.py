"""services.grpc_server on a real aio server: requests that do not parse are INVALID_ARGUMENT
(not UNKNOWN), good ones still reach the servicer, and the receive bound refuses big ones."""

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest

from services.grpc_server import Health, make_server
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc

CORRUPT = b"\xff\xff\xff"                      # not protobuf at all
BAD_UTF8 = b"\x1a\x02\xff\xfe"                 # GenerateRequest.text with invalid UTF-8


class EchoServicer(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request: generation_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        yield generation_pb2.GenerateResponse(text=request.text)

    async def GenerateOnce(self, request: generation_pb2.GenerateRequest,  # type: ignore[override]
                           context: grpc.aio.ServicerContext) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(text=request.text)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        return generation_pb2.TokenizeResponse(prompt=request.text)


def serve(test: Callable[[grpc.aio.Channel], Coroutine[Any, Any, None]],
          max_receive_bytes: int | None = None) -> None:
    async def main() -> None:
        server = make_server() if max_receive_bytes is None else make_server(max_receive_bytes)
        generation_pb2_grpc.add_GenerationServicer_to_server(EchoServicer(), server)
        Health(server, ["splitserve.v1.Generation"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await test(channel)
        finally:
            await server.stop(None)
    asyncio.run(main())


async def raw_call(channel: grpc.aio.Channel, method: str, payload: bytes) -> list[bytes]:
    """Sends bytes as they are (no serializer) and returns the raw responses."""
    path = f"/splitserve.v1.Generation/{method}"
    if method == "Generate":
        return [r async for r in channel.unary_stream(path)(payload, timeout=10)]
    return [await channel.unary_unary(path)(payload, timeout=10)]


@pytest.mark.parametrize("method", ["Generate", "GenerateOnce", "Tokenize"])
@pytest.mark.parametrize("payload", [CORRUPT, BAD_UTF8], ids=["corrupt", "bad-utf8"])
def test_unparsable_request_is_invalid_argument(method: str, payload: bytes) -> None:
    async def test(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw_call(channel, method, payload)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not be parsed" in (info.value.details() or "")
    serve(test)


@pytest.mark.parametrize("method", ["Generate", "GenerateOnce", "Tokenize"])
def test_good_requests_still_reach_the_servicer(method: str) -> None:
    request = generation_pb2.GenerateRequest(text="héllo").SerializeToString()
    if method == "Tokenize":
        request = generation_pb2.TokenizeRequest(text="héllo").SerializeToString()

    async def test(channel: grpc.aio.Channel) -> None:
        for _ in range(2):                         # the second call takes the cached wrapper
            [raw] = await raw_call(channel, method, request)
            if method == "Tokenize":
                assert generation_pb2.TokenizeResponse.FromString(raw).prompt == "héllo"
            else:
                assert generation_pb2.GenerateResponse.FromString(raw).text == "héllo"
    serve(test)


def test_health_still_answers() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def test(channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.unary_unary("/grpc.health.v1.Health/Check")(CORRUPT, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    serve(test)


def test_receive_bound_refuses_larger_requests_unread() -> None:
    async def test(channel: grpc.aio.Channel) -> None:
        small = generation_pb2.GenerateRequest(text="x" * 1000).SerializeToString()
        await raw_call(channel, "GenerateOnce", small)
        big = generation_pb2.GenerateRequest(text="x" * 5000).SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw_call(channel, "GenerateOnce", big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    serve(test, max_receive_bytes=4096)
