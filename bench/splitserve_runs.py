"""splitserve as a benchmark subject: a fresh cluster (all services as processes), timed over
gRPC on the shared workload, CPU or GPU workers alike.

`bench_splitserve` starts the cluster, warms it up untimed, then times one single stream (time
to first token, decode tokens/s) and all prompts at once (tokens/s, prefill included). It also
reads the workers' idle time between forward passes from ServerInfo (the StepTimings gap
metric, summed by the scheduler) over each timed part.

The batch client is one asyncio event loop (grpc.aio), as a load generator should be: 64 threads
blocking on sync streams cost about twice its CPU time (0.9-1.2 against 0.4-0.6 CPU-seconds per
run, measured). It stands for clients on other machines, but here it shares the services'
cores, and every token it reads wakes it while the worker's threads want both cores: the timed
batch runs it in a process of its own at nice CLIENT_NICE (`batch_client_process`), so that it
takes the CPU the services leave. On 2 cores (Xeon family 6 model 207, bf16) that made the batch
run 5.6-5.9 % faster in two alternating pairs, the workers' gap between steps 6.0 -> 5.5 ms.
HF transformers and vLLM run offline in the bench, with no client at all. `BatchClients` spreads
one batch over several such processes, each with its own channel, started together
(bench/host_ceiling.py)."""

import asyncio
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from process_tree import TreeCpu, read_stat  # noqa: E402

from services.launcher import ClusterSpec, ServiceProcesses  # noqa: E402
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text=prompt, sampling=generation_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def run_stream(stub: generation_pb2_grpc.GenerationStub, prompt: str, max_tokens: int,
               ) -> tuple[int, float, float]:
    """(tokens, seconds to first token, seconds in all)."""
    start = time.perf_counter()
    first = None
    n = 0
    for chunk in stub.Generate(request(prompt, max_tokens), timeout=1800):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
        n += len(chunk.token_ids)
    return n, first or 0.0, time.perf_counter() - start


# How the batch client asks (`run_batch`'s `api`), and the name of its row in the benches'
# tables: Generate (a message per token) or GenerateOnce (one reply).
BATCH_APIS = {"stream": "splitserve", "once": "splitserve once"}


def batch_apis(choice: str) -> list[str]:
    """A bench's --batch-api choice ("stream", "once" or "both") as the apis to run."""
    return list(BATCH_APIS) if choice == "both" else [choice]


def run_batch(address: str, prompts: list[str], max_tokens: int,
              arrivals: list[list[tuple[float, int]]] | None = None,
              api: str = "stream", probe: bool = True) -> list[int]:
    """Every prompt sent at once from one event loop; the tokens each got. `api` "stream":
    Generate, every token streamed as it comes; "once": GenerateOnce, each completion in one
    reply (as the peers' offline batch APIs return theirs), but for the last prompt, which
    streams as a probe of the step times (`full_batch_step_ms`) unless `probe` is off.
    `arrivals`, if given, receives each request's chunks as (perf_counter time, tokens in the
    chunk), in prompt order: one chunk for each reply of "once"."""
    import grpc

    async def stream_all() -> list[int]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await send_all(stub, prompts, max_tokens, got, api, probe)

    got: list[list[tuple[float, int]]] = [[] for _ in prompts]
    try:
        return asyncio.run(stream_all())
    finally:
        if arrivals is not None:
            arrivals.extend(got)


async def send_all(stub: generation_pb2_grpc.GenerationStub, prompts: list[str],
                   max_tokens: int, got: list[list[tuple[float, int]]], api: str = "stream",
                   probe: bool = True) -> list[int]:
    """`run_batch`'s requests on an open channel's `stub`: every prompt at once, the tokens
    each got; `got[i]` receives prompt i's chunks as they arrive."""

    async def one(i: int, prompt: str) -> int:
        n, seen = 0, []
        if api == "once" and (i < len(prompts) - 1 or not probe):
            reply = await stub.GenerateOnce(request(prompt, max_tokens), timeout=1800)
            n = len(reply.token_ids)
            seen.append((time.perf_counter(), n))
        else:
            async for chunk in stub.Generate(request(prompt, max_tokens), timeout=1800):
                if chunk.token_ids:
                    seen.append((time.perf_counter(), len(chunk.token_ids)))
                n += len(chunk.token_ids)
        got[i] = seen
        return n

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def full_batch_step_ms(arrivals: list[list[tuple[float, int]]], api: str = "stream") -> float:
    """The mean step time while every request decodes: from the last request's first token to
    the first request's last, each step gives every request one token, so the steps there are
    the tokens the first-finishing request got after the start of that span. Where replies
    came whole (`run_batch`'s "once"), its streamed probe, sent last, stands for the last
    request's first token and counts the steps, up to the first whole reply."""
    if api == "once":
        *whole, probe = arrivals
        start, end = probe[0][0], min(seen[0][0] for seen in whole)
        steps = sum(n for t, n in probe if start < t <= end)
        return 1000 * (end - start) / steps if steps else 0.0
    start = max(seen[0][0] for seen in arrivals)
    first_done = min(arrivals, key=lambda seen: seen[-1][0])
    steps = sum(n for t, n in first_done if t > start)
    return 1000 * (first_done[-1][0] - start) / steps if steps else 0.0


CLIENT_NICE = 10      # the timed batch client's niceness (the services run at 0)


def _client_child(address: str, prompts: list[str], max_tokens: int, nice: int, api: str,
                  conn: "multiprocessing.connection.Connection") -> None:
    os.nice(nice)
    arrivals: list[list[tuple[float, int]]] = []
    cpu = time.process_time()
    start = time.perf_counter()
    counts = run_batch(address, prompts, max_tokens, arrivals, api)
    wall = time.perf_counter() - start
    conn.send((counts, arrivals, wall, time.process_time() - cpu))
    conn.close()


def batch_client_process(address: str, prompts: list[str], max_tokens: int,
                         nice: int = CLIENT_NICE, api: str = "stream",
                         ) -> tuple[list[int], list[list[tuple[float, int]]], float, float]:
    """`run_batch` (`api`) in a fresh process at niceness `nice`: (tokens per prompt, arrivals, wall
    seconds from the first request to the last token, the client's CPU seconds). perf_counter
    is CLOCK_MONOTONIC, so the arrival times compare with this process's."""
    return in_child_process(_client_child, (address, prompts, max_tokens, nice, api),
                            "bench-client")


def in_child_process(target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
    """`target(*args, conn)` in a fresh (spawned) process; what it sends on `conn`. Spawned,
    not forked: no copy of this process's gRPC channels."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(*args, send), name=name)
    child.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the {name} process failed (exit code {child.exitcode})"
                           ) from None
    child.join()
    return result


def _client_share(address: str, prompts: list[str], max_tokens: int, api: str, nice: int,
                  connected: "multiprocessing.synchronize.Barrier",
                  start: "multiprocessing.synchronize.Barrier",
                  conn: "multiprocessing.connection.Connection") -> None:
    """One of `BatchClients`' processes: connect, wait for the others, send its share."""
    import grpc

    os.nice(nice)

    async def main() -> tuple[list[int], float, float, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            await channel.channel_ready()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, connected.wait, BARRIER_TIMEOUT_S)
            await loop.run_in_executor(None, start.wait, BARRIER_TIMEOUT_S)
            cpu, began = time.process_time(), time.perf_counter()
            counts = await send_all(generation_pb2_grpc.GenerationStub(channel), prompts,
                                    max_tokens, [[] for _ in prompts], api, probe=False)
            return counts, began, time.perf_counter(), time.process_time() - cpu

    conn.send(asyncio.run(main()))
    conn.close()


BARRIER_TIMEOUT_S = 300.0     # client processes to start and connect, or the run to begin


class BatchClients:
    """`num_procs` client processes, each with its own gRPC channel and every
    `num_procs`-th prompt, all sent at once (`send_all`; "once" without a streamed probe),
    at niceness `nice`. Construction returns once every process is connected; `run` starts
    them together: the load of many clients on other machines, as far as one machine
    allows."""

    def __init__(self, address: str, prompts: list[str], max_tokens: int, num_procs: int,
                 api: str = "stream", nice: int = CLIENT_NICE) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of this process's gRPC channels
        connected, self._start = ctx.Barrier(num_procs + 1), ctx.Barrier(num_procs + 1)
        self._children = []
        self._conns = []
        for i in range(num_procs):
            receive, send = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_client_share, name=f"bench-client-{i}", args=(
                address, prompts[i::num_procs], max_tokens, api, nice, connected,
                self._start, send))
            child.start()
            send.close()
            self._children.append(child)
            self._conns.append(receive)
        try:
            connected.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            self._fail("did not connect")

    def run(self) -> tuple[list[int], float, float]:
        """Start every client at once: (tokens per prompt, in client order; wall seconds from
        the first request to the last token; the clients' CPU seconds in all)."""
        try:
            self._start.wait(BARRIER_TIMEOUT_S)
            results = [conn.recv() for conn in self._conns]
        except (threading.BrokenBarrierError, EOFError):
            self._fail("failed")
        for child in self._children:
            child.join()
        counts = [n for result in results for n in result[0]]
        wall = max(r[2] for r in results) - min(r[1] for r in results)
        return counts, wall, sum(r[3] for r in results)

    def _fail(self, what: str) -> NoReturn:
        for child in self._children:
            child.kill()
            child.join()
        codes = [child.exitcode for child in self._children]
        raise RuntimeError(f"the bench's client processes {what} (exit codes {codes})")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used, from /proc; 0 where it is gone."""
    stat = read_stat(pid)
    return 0.0 if stat is None else stat.cpu_s


class CpuUse:
    """CPU seconds each service used over an interval, its process and all their descendants
    (the scheduler's engine cores and front ends are its children): what the split's own parts
    (scheduler, kvcache_svc) take from the workers' cores (`batch_client_process` reports the
    client's). Robust to a noisy machine, unlike wall times."""

    def __init__(self, procs: ServiceProcesses) -> None:
        self.trees = {name: TreeCpu([p.pid]) for name, p in procs.procs.items()}
        self.start = {name: tree.snapshot() for name, tree in self.trees.items()}

    def since_start(self) -> dict[str, float]:
        """Per service: the CPU its processes used since the start (one started in between
        counts from 0; one that ended in between is lost)."""
        used = {}
        for name, tree in self.trees.items():
            before = self.start[name]
            used[name] = sum(cpu - before.get(key, (label, 0.0))[1]
                             for key, (label, cpu) in tree.snapshot().items())
        return used


class ForwardGaps:
    """The workers' idle time between forward passes over an interval, from the scheduler's
    ServerInfo counters (summed over replicas): the gap total, how many gaps it covers, and
    the engine steps run."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub) -> None:
        self.stub = stub
        self.last = self._totals()

    def _totals(self) -> tuple[float, int, int]:
        info = self.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)
        return (sum(r.forward_gap_ms_total for r in info.replicas),
                sum(r.num_forward_gaps for r in info.replicas),
                sum(r.num_steps for r in info.replicas))

    def since_last(self) -> tuple[float, int, int]:
        """(gap milliseconds, gaps, steps) since the previous call (or construction)."""
        now = self._totals()
        delta = (now[0] - self.last[0], now[1] - self.last[1], now[2] - self.last[2])
        self.last = now
        return delta

    def mean_since_last(self) -> float:
        gap_ms, num_gaps, _ = self.since_last()
        return gap_ms / num_gaps if num_gaps else 0.0


def bench_splitserve(prompts: list[str], single: str, max_tokens: int, dtype: str,
                     extra_args: list[str], worker_args: list[str], pp: int = 1,
                     tp: int = 1, model: str | None = None,
                     warmup_prompts: Sequence[str] | None = None,
                     ready_timeout_s: float = 300.0, batch_api: str = "stream",
                     ) -> dict[str, float]:
    """One round on a fresh cluster. `warmup_prompts`: what the untimed warm-up sends (default
    the first 8 prompts and `single`; a GPU run passes other texts, so that the timed prompts
    find nothing of theirs in the prefix cache and every batch size has been seen).

    batch_idle_fraction = the last stage's summed gaps between forwards during the batch run
    / the batch run's wall time: the share of the run the GPU sat idle between steps (idle
    before the first step and after the last is not in it). batch_cpu_s: CPU seconds each
    process used during the batch run (`CpuUse`; the client's from its own process, which runs
    at nice CLIENT_NICE: `batch_client_process`). `batch_api`: how the batch client asks
    (`run_batch`'s `api`)."""
    import grpc

    port = free_port()
    spec = ClusterSpec(model=model, port=port, kv_plan_port=free_port(),
                       kv_admin_port=free_port(), kv_events_port=free_port(), metrics_port=-1,
                       control_port=free_port(),
                       dtype=dtype, tp=tp, pp=pp, scheduler_args=tuple(extra_args),
                       worker_args=tuple(worker_args),
                       log_level="warning")
    log_dir = Path(tempfile.mkdtemp(prefix="splitserve-bench-"))
    procs = ServiceProcesses(spec, log_dir)
    procs.start()
    try:
        try:
            procs.wait_ready(ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; service logs in {log_dir}") from exc
        with grpc.insecure_channel(procs.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # Warm-up: a batch and a single stream, untimed.
            warm_batch = list(warmup_prompts) if warmup_prompts else prompts[:8]
            run_batch(procs.address, warm_batch, 16)
            run_stream(stub, warm_batch[0] if warmup_prompts else single, 16)

            gaps = ForwardGaps(stub)
            n, ttft, total = run_stream(stub, single, max_tokens)
            single_decode = (n - 1) / (total - ttft)
            single_gap = gaps.mean_since_last()
            cpu = CpuUse(procs)
            counts, arrivals, wall, client_cpu = batch_client_process(
                procs.address, prompts, max_tokens, api=batch_api)
            batch_cpu = {**cpu.since_start(), "client": client_cpu}
            decode_step_ms = full_batch_step_ms(arrivals, batch_api)
            gap_ms, num_gaps, num_steps = gaps.since_last()
            assert sum(counts) == len(prompts) * max_tokens, counts
    finally:
        procs.stop()
    return {"batch_tok_s": sum(counts) / wall, "batch_wall_s": wall,
            "single_ttft_ms": ttft * 1000, "single_decode_tok_s": single_decode,
            "single_forward_gap_ms": single_gap,
            "batch_forward_gap_ms": gap_ms / num_gaps if num_gaps else 0.0,
            "batch_idle_fraction": gap_ms / (wall * 1000), "batch_num_steps": num_steps,
            "batch_cpu_s": batch_cpu,
            "batch_decode_step_ms": decode_step_ms}
