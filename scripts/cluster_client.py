"""A deployed cluster checked from outside, through its public ports only: the helpers that
scripts/compose_scenario.py and scripts/swarm_scenario.py share (and tests/e2e/test_multi_host.py
through its load).

- `reference_answers`: the greedy answers of a local cluster (services.launcher, float32,
  one thread per worker) that every deployment must reproduce token for token.
- `ready_replicas`, `wait_until`: ServerInfo polled until the cluster has the shape asked.
- `RequestLoad`: client threads that keep sending greedy requests while the cluster changes
  underneath (a worker killed, replicas added or removed, a scheduler draining) and count
  every answer that is late, short, wrong or an error.
- `deployment_env`: the environment a deployment under check runs with (a fresh cluster
  token, the reference's dtype and threads).
- `check_greedy`, `wait_replica_steps`: every reference answered exactly; a new replica took
  requests.
- `fetch_metrics`: the Prometheus text of the metrics port.
- `Timer`: each step of a scenario announced, timed, and the times listed at the end.

A check that fails raises `CheckFailed` with what was expected and what was seen.
"""

import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

# Prompts whose greedy answers (SmolLM2-135M-Instruct, float32) have clear top-1 margins, so a
# token-exact comparison across processes, containers and hosts tests the deployment and not
# rounding.
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "A haiku about the sea:",
)
MAX_TOKENS = 64          # reference length; the load asks for a prefix of it
LOAD_TOKENS = 16

T = TypeVar("T")


class CheckFailed(AssertionError):
    """A deployment check did not hold."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def greedy_request(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text=prompt, sampling=generation_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def generate(stub: generation_pb2_grpc.GenerationStub, prompt: str, max_tokens: int,
             timeout_s: float = 120.0,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """One streamed greedy request; its token ids. Raises CheckFailed unless it ran to
    `max_tokens` and finished for length."""
    ids: list[int] = []
    finish = ""
    for chunk in stub.Generate(greedy_request(prompt, max_tokens), timeout=timeout_s):
        ids.extend(chunk.token_ids)
        if on_token is not None and chunk.token_ids:
            on_token(len(ids))
        finish = chunk.finish_reason or finish
    if finish != "length" or len(ids) != max_tokens:
        raise CheckFailed(f"{prompt!r}: finished {finish!r} after {len(ids)} of {max_tokens} "
                          "tokens")
    return ids


def reference_answers(prompts: Sequence[str] = PROMPTS, max_tokens: int = MAX_TOKENS,
                      ) -> dict[str, list[int]]:
    """Each prompt's greedy answer from a local cluster on this machine (float32, one replica,
    one thread): what the deployed cluster, configured alike, must answer."""
    from services.launcher import ClusterSpec, ServiceProcesses

    ports = [free_port() for _ in range(7)]
    spec = ClusterSpec(port=ports[0], control_port=ports[1], kv_plan_port=ports[2],
                       kv_admin_port=ports[3], kv_events_port=ports[4],
                       kv_store_port=ports[5], metrics_port=ports[6], dtype="float32",
                       threads_per_worker=1, worker_args=("--kv-cache-memory-gib", "0.25"))
    with tempfile.TemporaryDirectory(prefix="reference-") as logs:
        procs = ServiceProcesses(spec, Path(logs))
        procs.start()
        try:
            procs.wait_ready(180)
            with grpc.insecure_channel(procs.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                return {p: generate(stub, p, max_tokens) for p in prompts}
        except Exception as exc:
            text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                             for p in sorted(Path(logs).glob("*.log")))
            raise CheckFailed(f"the local reference cluster failed: {exc}\n{text}") from exc
        finally:
            procs.stop()


def load_references(path: Path | None) -> dict[str, list[int]]:
    """The reference answers from `path` when it exists; else computed (and saved there, so
    the next scenario of the same run reuses them)."""
    if path is not None and path.exists():
        return json.loads(path.read_text())
    references = reference_answers()
    if path is not None:
        path.write_text(json.dumps(references))
    return references


class Timer:
    """`with timer.step("name"):` prints the step's start and end with its seconds;
    `report()` lists every finished step."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        print(f"compose-check: {name} ...", flush=True)
        t0 = time.monotonic()
        yield
        self.times.append((name, time.monotonic() - t0))
        print(f"compose-check: {name} ok ({time.monotonic() - t0:.1f} s)", flush=True)

    def report(self) -> None:
        for name, seconds in self.times:
            print(f"compose-check:   {name:<11} {seconds:6.1f} s", flush=True)


def server_info(stub: generation_pb2_grpc.GenerationStub,
                ) -> generation_pb2.ServerInfoResponse:
    return stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=5)


def ready_replicas(info: generation_pb2.ServerInfoResponse) -> list[generation_pb2.ReplicaInfo]:
    return [r for r in info.replicas if r.state == "ready"]


def describe(info: generation_pb2.ServerInfoResponse) -> str:
    """One line per replica: id, state, its workers (id, epoch), steps run."""
    def workers(r: generation_pb2.ReplicaInfo) -> str:
        return ", ".join(f"{w.worker_id}@{w.epoch}" for w in r.workers)

    return "; ".join(f"replica {r.replica_id} {r.state} [{workers(r)}] {r.num_steps} steps"
                     for r in info.replicas) or "no replicas"


def wait_until(what: str, probe: Callable[[], T | None], timeout_s: float,
               describe_last: Callable[[], str] = lambda: "", interval_s: float = 0.5) -> T:
    """Polls `probe` until it returns something other than None (errors count as None);
    raises CheckFailed naming `what` and the last state after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            if (value := probe()) is not None:
                return value
        except (grpc.RpcError, OSError) as exc:
            last_error = f" (last error: {exc})"
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {timeout_s:.0f}s{last_error}; "
                              f"{describe_last()}")
        time.sleep(interval_s)


def wait_replicas(stub: generation_pb2_grpc.GenerationStub, count: int, timeout_s: float,
                  also: Callable[[generation_pb2.ServerInfoResponse], bool] = lambda i: True,
                  ) -> generation_pb2.ServerInfoResponse:
    """ServerInfo once exactly `count` replicas are ready (and `also` holds)."""
    last: list[generation_pb2.ServerInfoResponse] = []

    def probe() -> generation_pb2.ServerInfoResponse | None:
        info = server_info(stub)
        last[:] = [info]
        return info if len(ready_replicas(info)) == count and also(info) else None

    return wait_until(f"{count} ready replica(s)", probe, timeout_s,
                      lambda: describe(last[0]) if last else "ServerInfo never answered")


def deployment_env() -> dict[str, str]:
    """This process's environment plus what a deployment under check runs with: a fresh
    cluster token, and float32 with one thread per worker as `reference_answers` (2 cores)."""
    return {**os.environ,
            "SPLITSERVE_CLUSTER_TOKEN": os.urandom(32).hex(),
            "SPLITSERVE_DTYPE": "float32",
            "SPLITSERVE_WORKER_THREADS": "1"}


def check_greedy(stub: generation_pb2_grpc.GenerationStub, references: dict[str, list[int]],
                 who: str) -> None:
    """Every reference prompt answered token-exact by the deployment (`who`, for the error)."""
    for prompt, want in references.items():
        got = generate(stub, prompt, len(want))
        if got != want:
            raise CheckFailed(f"{prompt!r}: {who} answered {got}, the local cluster {want}")


def wait_replica_steps(stub: generation_pb2_grpc.GenerationStub, replica_id: int,
                       timeout_s: float = 60) -> None:
    """Until replica `replica_id` has run a step (the router gave it work)."""
    def stepped() -> bool | None:
        return True if any(r.replica_id == replica_id and r.num_steps > 0
                           for r in server_info(stub).replicas) else None

    wait_until(f"replica {replica_id} takes requests", stepped, timeout_s,
               describe_last=lambda: describe(server_info(stub)))


def fetch_metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        if response.status != 200:
            raise CheckFailed(f"{url}: HTTP {response.status}")
        return response.read().decode()


@dataclass
class LoadResult:
    num_answered: int = 0
    failures: list[str] = field(default_factory=list)


class RequestLoad:
    """`num_clients` threads, each sending greedy requests (the prompts in turn, LOAD_TOKENS
    tokens) one after another until stopped; every answer must equal the reference's prefix.
    Use as a context manager; `check(min_answered)` after the block."""

    def __init__(self, address: str, references: dict[str, list[int]], num_clients: int = 2,
                 timeout_s: float = 120.0) -> None:
        self.address = address
        self.references = references
        self.num_clients = num_clients
        self.timeout_s = timeout_s
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "RequestLoad":
        for i in range(self.num_clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True,
                                      name=f"load-{i}")
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 10)

    @property
    def num_answered(self) -> int:
        with self._lock:
            return self.result.num_answered

    def wait_answers(self, more: int, timeout_s: float) -> None:
        """Blocks until `more` further answers came back (a cluster that serves on)."""
        target = self.num_answered + more
        wait_until(f"{more} more answered requests", lambda: True if self.num_answered
                   >= target else None, timeout_s, lambda: f"{self.num_answered} so far, "
                   f"failures: {self.result.failures[:3]}")

    def _client(self, index: int) -> None:
        prompts = list(self.references)
        with grpc.insecure_channel(self.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            turn = index
            while not self._stop.is_set():
                prompt = prompts[turn % len(prompts)]
                turn += 1
                want = self.references[prompt][:LOAD_TOKENS]
                started = time.monotonic()
                try:
                    got = generate(stub, prompt, LOAD_TOKENS, self.timeout_s)
                    error = None if got == want else f"{prompt!r}: {got} != {want}"
                except (grpc.RpcError, CheckFailed) as exc:
                    code = exc.code().name if isinstance(exc, grpc.RpcError) else ""
                    details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                    error = f"{prompt!r}: {code} {details} after {time.monotonic() - started:.1f}s"
                with self._lock:
                    if error is None:
                        self.result.num_answered += 1
                    else:
                        self.result.failures.append(error)

    def check(self, min_answered: int) -> LoadResult:
        """Raises CheckFailed if any request failed or fewer than `min_answered` came back."""
        result = self.result
        if result.failures:
            raise CheckFailed(f"{len(result.failures)} request(s) failed under load "
                              f"({result.num_answered} answered): {result.failures[:5]}")
        if result.num_answered < min_answered:
            raise CheckFailed(f"only {result.num_answered} requests answered under load "
                              f"(at least {min_answered} expected)")
        return result
