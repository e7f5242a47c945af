"""services.grpc_server.CallLimit on a real aio server: calls past the bound are refused at
once with RESOURCE_EXHAUSTED naming the flag, health checks are neither counted nor refused,
the count comes back however calls end, and a burst of thousands of calls on one channel is
refused, never CANCELLED, while another client's calls in flight finish.

Without the raised backlog (make_server's MAX_PENDING_CALLS), the burst test fails: grpc
cancels the calls past its own backlog of ~1,000, the control client's among them."""

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from http_svc.errors import from_grpc
from scheduler_svc.__main__ import parse_args
from scheduler_svc.config import ServerConfig
from services.grpc_server import CallLimit, Health, make_server
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc

FLAG = "--max-concurrent-calls"
NUM_BURST = 5000


class HeldServicer(generation_pb2_grpc.GenerationServicer):
    """Generate holds each call until `release` is set (text "fail": raises after it); a
    request's `request_id` of "sleep" sleeps 0.3 s instead."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.num_running = 0

    async def Generate(self, request: generation_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.num_running += 1
        try:
            if request.request_id == "sleep":
                await asyncio.sleep(0.3)
            else:
                await self.release.wait()
            if request.text == "fail":
                raise RuntimeError("the servicer failed")
            yield generation_pb2.GenerateResponse(text=request.text)
        finally:
            self.num_running -= 1

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        return generation_pb2.TokenizeResponse(prompt=request.text)


# (a channel to the server, its address, its CallLimit, its servicer)
Test = Callable[[grpc.aio.Channel, str, CallLimit, HeldServicer], Coroutine[Any, Any, None]]


def serve(test: Test, max_calls: int) -> None:
    async def main() -> None:
        limit = CallLimit(max_calls, FLAG)
        server = make_server(call_limit=limit)
        servicer = HeldServicer()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        health = Health(server, ["splitserve.v1.Generation"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.set_live()
        try:
            target = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(target) as channel:
                await test(channel, target, limit, servicer)
        finally:
            await server.stop(None)
    asyncio.run(main())


async def outcome(call: Any) -> str:
    """"OK", or the status code's name and details."""
    try:
        [_ async for _ in call]
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_past_the_bound_a_call_is_refused_naming_the_flag() -> None:
    async def test(channel: grpc.aio.Channel, target: str, limit: CallLimit,
                   servicer: HeldServicer) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        held = [asyncio.ensure_future(outcome(stub.Generate(
            generation_pb2.GenerateRequest(text=f"held {i}"), timeout=10))) for i in range(3)]
        await until(lambda: servicer.num_running == 3)
        assert limit.num_calls == 3
        refused = await outcome(stub.Generate(generation_pb2.GenerateRequest(text="4th")))
        assert refused == ("RESOURCE_EXHAUSTED: this server already serves 3 calls at "
                           f"once ({FLAG}); try again later")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(generation_pb2.TokenizeRequest(text="x"), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Health checks are not counted: they answer while the bound is reached.
        check = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        servicer.release.set()
        assert await asyncio.gather(*held) == ["OK"] * 3
        assert limit.num_calls == 0 and limit.num_refused == 2
        assert (await stub.Tokenize(generation_pb2.TokenizeRequest(text="x"))).prompt == "x"
    serve(test, max_calls=3)


def test_the_count_comes_back_however_calls_end() -> None:
    async def test(channel: grpc.aio.Channel, target: str, limit: CallLimit,
                   servicer: HeldServicer) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        cancelled = [stub.Generate(generation_pb2.GenerateRequest(text="c")) for _ in range(4)]
        failing = [asyncio.ensure_future(outcome(stub.Generate(
            generation_pb2.GenerateRequest(text="fail")))) for _ in range(4)]
        await until(lambda: limit.num_calls == 8)
        for call in cancelled:
            call.cancel()
        await until(lambda: limit.num_calls == 4)
        servicer.release.set()
        assert {o.split(":")[0] for o in await asyncio.gather(*failing)} == {"UNKNOWN"}
        await until(lambda: limit.num_calls == 0)
        # The bound is whole again: 8 calls at once are served.
        servicer.release.clear()
        again = [asyncio.ensure_future(outcome(stub.Generate(
            generation_pb2.GenerateRequest(text="ok")))) for _ in range(8)]
        await until(lambda: servicer.num_running == 8)
        servicer.release.set()
        assert await asyncio.gather(*again) == ["OK"] * 8
    serve(test, max_calls=8)


def test_a_burst_is_refused_and_cancels_no_other_call() -> None:
    """One channel opens NUM_BURST calls at once; another client's calls, in flight before
    it and sent during it, are never CANCELLED and those in flight finish."""
    async def test(channel: grpc.aio.Channel, target: str, limit: CallLimit,
                   servicer: HeldServicer) -> None:
        async with grpc.aio.insecure_channel(
                target, options=[("grpc.use_local_subchannel_pool", 1)]) as flood_channel:
            control = generation_pb2_grpc.GenerationStub(channel)
            flooder = generation_pb2_grpc.GenerationStub(flood_channel)
            await flood_channel.channel_ready()
            in_flight = [asyncio.ensure_future(outcome(control.Generate(
                generation_pb2.GenerateRequest(text="control"), timeout=60)))
                for _ in range(8)]
            await until(lambda: limit.num_calls == 8)
            burst = [asyncio.ensure_future(outcome(flooder.Generate(
                generation_pb2.GenerateRequest(request_id="sleep", text="flood"),
                timeout=60))) for _ in range(NUM_BURST)]
            during = []
            for _ in range(5):
                await asyncio.sleep(0.1)
                during.append(asyncio.ensure_future(outcome(control.Generate(
                    generation_pb2.GenerateRequest(request_id="sleep", text="control"),
                    timeout=60))))
            flooded = collections.Counter(o for o in await asyncio.gather(*burst))
            servicer.release.set()
            assert await asyncio.gather(*in_flight) == ["OK"] * 8
            sent_during = collections.Counter(o.split(":")[0]
                                              for o in await asyncio.gather(*during))
        refusal = (f"RESOURCE_EXHAUSTED: this server already serves 64 calls at once "
                   f"({FLAG}); try again later")
        print(dict(flooded), dict(sent_during))
        assert set(flooded) <= {"OK", refusal}, flooded
        assert flooded[refusal] > NUM_BURST // 2
        assert set(sent_during) <= {"OK", "RESOURCE_EXHAUSTED"}, sent_during
        await until(lambda: limit.num_calls == 0)
    serve(test, max_calls=64)


def test_over_http_the_refusal_is_a_429_not_a_413() -> None:
    """http_svc tells a load refusal (429, as the scheduler's full queue) from gRPC's own
    "message larger than max" (413) by its text."""
    refusal = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
        f"this server already serves 8192 calls at once ({FLAG}); try again later")
    error = from_grpc(refusal)
    assert error.status == 429 and FLAG in error.message


def test_the_flag_sets_the_front_ends_bound() -> None:
    assert parse_args([]).server.max_concurrent_calls == ServerConfig("", "").max_concurrent_calls
    assert parse_args([FLAG, "100"]).server.max_concurrent_calls == 100
    with pytest.raises(SystemExit):
        parse_args([FLAG, "0"])
    with pytest.raises(ValueError, match=FLAG):
        CallLimit(0, FLAG)
