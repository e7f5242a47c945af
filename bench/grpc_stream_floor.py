"""What grpc.aio itself costs per streamed message: the floor under the scheduler front end's
CPU per streamed token (issue 37's target is 35 µs per token at one message per token).

    .venv/bin/python bench/grpc_stream_floor.py [--streams 64 256] [--tokens 128] [--rounds 3]

A server process serves `Generate` with nothing of ours in it: every `--step-ms` one tick wakes
every open stream, which writes one small GenerateResponse (one token id, a short text) with
`context.write`, as the front end's `Generate` does. Clients in two processes (as
bench/host_ceiling.py spreads them) open the streams and read `--tokens` messages each. The
figure is the server process's CPU time (user + system, from time.process_time in that
process) over the round, per message received. Whatever the front end costs above this
(bench/host_ceiling.py --null-step-ms 10 prints its µs per streamed token) is ours.
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

CLIENT_PROCESSES = 2


class TickServicer(generation_pb2_grpc.GenerationServicer):
    """Each open stream writes one message per tick, `tokens` in all."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.tick: asyncio.Future[None] | None = None

    def next_tick(self) -> "asyncio.Future[None]":
        if self.tick is None:
            self.tick = asyncio.get_running_loop().create_future()
        return self.tick

    async def ticker(self, step_s: float) -> None:
        while True:
            await asyncio.sleep(step_s)
            tick, self.tick = self.tick, None
            if tick is not None:
                tick.set_result(None)

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        for i in range(self.tokens):
            await self.next_tick()
            await context.write(generation_pb2.GenerateResponse(
                request_id=request.request_id, token_ids=[i], text=" token", index=0))


async def serve(tokens: int, step_s: float, pipe: Connection) -> None:
    server = grpc.aio.server()
    servicer = TickServicer(tokens)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ticker = asyncio.ensure_future(servicer.ticker(step_s))
    pipe.send(port)
    loop = asyncio.get_running_loop()
    while (command := await loop.run_in_executor(None, pipe.recv)) != "quit":
        if command == "start":
            started = time.process_time()
        else:
            pipe.send(time.process_time() - started)
    ticker.cancel()
    await server.stop(0)


def server_main(tokens: int, step_s: float, pipe: Connection) -> None:
    asyncio.run(serve(tokens, step_s, pipe))


async def read_streams(port: int, streams: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> int:
            request = generation_pb2.GenerateRequest(model="m", request_id=f"r{i}")
            return sum([1 async for _ in stub.Generate(request)])
        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def client_main(port: int, streams: int, out: "mp.Queue[int]") -> None:
    out.put(asyncio.run(read_streams(port, streams)))


def measure(streams: int, tokens: int, step_s: float, rounds: int) -> list[float]:
    """Server CPU µs per message, one figure per round (a first warm-up round not counted)."""
    ours, theirs = mp.Pipe()
    server = mp.Process(target=server_main, args=(tokens, step_s, theirs))
    server.start()
    port = ours.recv()
    figures = []
    try:
        for round_ in range(rounds + 1):
            ours.send("start")
            out: mp.Queue[int] = mp.Queue()
            clients = [mp.Process(target=client_main,
                                  args=(port, streams // CLIENT_PROCESSES, out))
                       for _ in range(CLIENT_PROCESSES)]
            for client in clients:
                client.start()
            messages = sum(out.get() for _ in clients)
            for client in clients:
                client.join()
            ours.send("stop")
            cpu_s = ours.recv()
            if round_:
                figures.append(cpu_s / messages * 1e6)
    finally:
        ours.send("quit")
        server.join()
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--tokens", type=int, default=128, help="messages per stream")
    p.add_argument("--step-ms", type=float, default=10.0, help="time between ticks")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(f"grpcio {grpc.__version__}; server CPU per streamed message (µs), one per round")
    for streams in a.streams:
        figures = measure(streams, a.tokens, a.step_ms / 1000, a.rounds)
        print(f"{streams:4d} streams: " + "  ".join(f"{f:.1f}" for f in figures)
              + f"   (median {sorted(figures)[len(figures) // 2]:.1f})")


if __name__ == "__main__":
    main()
