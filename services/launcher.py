"""Starts the services as separate processes and stops them together.

`Cluster processes` = one kvcache_svc, one scheduler_svc, tp*pp*replicas worker_svc and, when
the spec has an HTTP port, one http_svc (the OpenAI-compatible API in front of the scheduler),
each a child `python -m <service>`. Used by `splitserve up` and by the end-to-end tests. If
any child dies, the rest are stopped and the launcher reports it; SIGTERM goes to every child,
then SIGKILL after a grace period.

The cluster token: every child gets the same `SPLITSERVE_CLUSTER_TOKEN` in its environment
(services.cluster_token): the one the spec's env or this process's environment names, else one
generated here for this set of processes. Restarted or added children get the same one, so
they can rejoin; the token is never logged.

Listeners: only the scheduler's client port, its metrics port and the HTTP API go on `host`.
The internal plane (the scheduler's control listener for worker registration and heartbeats,
kvcache_svc's plan, admin and events sockets, the workers' step sockets) is bound to 127.0.0.1
whatever `host` is: every process the launcher starts is on this machine.

GPUs: every worker gets a GPU of its own (`plan_devices`): worker i computes on `cuda:i`. One
GPU cannot host two NCCL ranks of a replica, and two workers sharing one would each size their
KV cache from its whole memory, so more workers than GPUs is refused before anything starts
(the scheduler refuses such a registration too; this catches it without a crash).
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import cluster_token, tls
from services.cpus import available_cpus
from services.service_flags import METRICS_PORT

REPO_ROOT = Path(__file__).resolve().parents[1]
# Every internal listener: its peers are all children of this launcher, on this machine.
INTERNAL_HOST = "127.0.0.1"
# Service flags the launcher always sets to values of its own (the internal plane's addresses,
# one id per worker), which no spec field chooses: `splitserve up` refuses them.
SET_BY_LAUNCHER = frozenset({"--control-host", "--advertise-host", "--kvcache", "--scheduler",
                             "--worker-id", "--plan-port", "--admin-port", "--events-port",
                             "--kv-store-port"})


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What to start; every field maps to a service flag."""

    model: str | None = None
    host: str = "127.0.0.1"                 # clients' and metrics' interface
    port: int = 50051                       # scheduler gRPC, public (clients)
    control_port: int = 50052               # scheduler gRPC, workers' control
    # kvcache_svc's ports below and the workers' step sockets are on 127.0.0.1 too
    kv_plan_port: int = 50053
    kv_admin_port: int = 50054
    kv_events_port: int = 50055             # KV events PUB (0: any free port)
    kv_store_port: int = 50057              # KV store ROUTER (0: any free port)
    metrics_port: int = METRICS_PORT        # scheduler Prometheus /metrics (-1: off, 0: any)
    http_port: int | None = None            # http_svc's OpenAI-compatible API on `host`;
                                            # None: not started (`splitserve up`: 8000)
    dtype: str | None = None                # None: the scheduler's own default (--dtype)
    tp: int = 1
    pp: int = 1
    num_replicas: int = 1
    scheduler_args: tuple[str, ...] = ()    # extra scheduler flags
    worker_args: tuple[str, ...] = ()       # extra worker flags
    kvcache_args: tuple[str, ...] = ()      # extra kvcache_svc flags (the KV store's)
    http_args: tuple[str, ...] = ()         # extra http_svc flags
    threads_per_worker: int = 0             # 0: this machine's CPUs / workers
    worker_devices: tuple[str, ...] = ()    # worker i's --device ("cpu", "cuda:N"); ():
                                            # each worker's own default (plan_devices)
    log_level: str = "info"
    env: dict[str, str] = field(default_factory=dict)   # extra environment for every child;
                                            # SPLITSERVE_CLUSTER_TOKEN here wins over ours


class DevicePlanError(ValueError):
    """The workers asked for cannot each get a device of their own on this machine."""


def plan_devices(device: str, tp: int, pp: int, num_replicas: int,
                 num_gpus: int) -> tuple[str, ...]:
    """Each worker's --device for `splitserve up --device DEVICE` (tp x pp x num_replicas
    workers) on a machine where torch sees `num_gpus` CUDA GPUs. "cpu": all on the CPU;
    "auto": "cuda" with a GPU, else "cpu"; "cuda": worker i on cuda:i; "cuda:N": the one
    worker on GPU N. Refuses more workers than GPUs: a worker needs a GPU of its own."""
    num_workers = tp * pp * num_replicas
    if device == "auto":
        device = "cuda" if num_gpus > 0 else "cpu"
    if device == "cpu":
        return ("cpu",) * num_workers
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise DevicePlanError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N")
    if num_gpus == 0:
        raise DevicePlanError(f"--device {device}: torch sees no CUDA GPU (a CPU build of "
                              f"torch, no driver, or CUDA_VISIBLE_DEVICES empty); use "
                              f"--device cpu")
    if device == "cuda":
        if num_workers > num_gpus:
            raise DevicePlanError(
                f"--device cuda: tp {tp} x pp {pp} x {num_replicas} replica(s) = "
                f"{num_workers} workers, but torch sees {num_gpus} GPU(s); each worker needs "
                f"its own GPU (one GPU cannot host two NCCL ranks): lower --replicas, --tp or "
                f"--pp, or use --device cpu")
        return tuple(f"cuda:{i}" for i in range(num_workers))
    if num_workers != 1:
        raise DevicePlanError(
            f"--device {device} names one GPU, but tp {tp} x pp {pp} x {num_replicas} "
            f"replica(s) = {num_workers} workers need one each; use --device cuda (worker i "
            f"on cuda:i) and CUDA_VISIBLE_DEVICES to choose which GPUs")
    if int(device[5:]) >= num_gpus:
        raise DevicePlanError(f"--device {device}: torch sees {num_gpus} GPU(s), "
                              f"cuda:0..cuda:{num_gpus - 1}")
    return (device,)


def resolve_token(spec_env: Mapping[str, str], environ: Mapping[str, str]) -> tuple[str, bool]:
    """The cluster token for one set of processes and whether someone chose it: the spec's,
    else the environment's, else a fresh one. An empty value counts as unset (`VAR= cmd`)."""
    chosen = spec_env.get(cluster_token.ENV) or environ.get(cluster_token.ENV)
    if chosen:
        return chosen, True
    return cluster_token.generate(), False


class ServiceProcesses:
    """The running children; `stop()` is idempotent."""

    def __init__(self, spec: ClusterSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Decided once: a child restarted later must present the same secret as the rest.
        self.cluster_token, self.token_chosen = resolve_token(spec.env, os.environ)

    @property
    def address(self) -> str:
        """The public gRPC address, where clients (and readiness checks) go."""
        return f"{self.spec.host}:{self.spec.port}"

    @property
    def control_address(self) -> str:
        """Where workers register and send heartbeats."""
        return f"{INTERNAL_HOST}:{self.spec.control_port}"

    def child_env(self) -> dict[str, str]:
        """Every child's environment: ours, the spec's additions and the one cluster token."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env,
               cluster_token.ENV: self.cluster_token}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                          env.get("PYTHONPATH")]))
        return env

    def _spawn(self, name: str, module: str, args: Sequence[str]) -> None:
        env = self.child_env()
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives with the child
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=env, stdout=out,
            stderr=subprocess.STDOUT if out else None, start_new_session=True)

    def start(self) -> None:
        s = self.spec
        self.start_kvcache()
        self.start_scheduler()
        for i in range(s.tp * s.pp * s.num_replicas):
            self._spawn(f"worker{i}", "worker_svc", self.worker_args(i))
        if s.http_port is not None:
            self.start_http()

    @property
    def http_address(self) -> str | None:
        """Where the OpenAI-compatible HTTP API listens (None: not started)."""
        port = self.spec.http_port
        return None if port is None else f"{self.spec.host}:{port}"

    def http_args(self) -> list[str]:
        """http_svc's command line: on --host beside the scheduler's client port, which it
        talks to."""
        s = self.spec
        scheduler_host = INTERNAL_HOST if s.host in ("0.0.0.0", "::") else s.host
        metrics = (f"http://{scheduler_host}:{s.metrics_port}/metrics" if s.metrics_port > 0
                   else "off")      # served again at http_svc's /metrics
        return ["--host", s.host, "--port", str(s.http_port),
                "--scheduler", f"{scheduler_host}:{s.port}", "--log-level", s.log_level,
                "--scheduler-metrics", metrics, *s.http_args, *self._scheduler_ca_args()]

    def scheduler_ca(self) -> str | None:
        """The CA to trust the scheduler's TLS client port with (services.tls): http_svc's
        --scheduler-ssl-ca, else the scheduler's own --ssl-certfile (self-signed); None:
        the port is plaintext."""
        s = self.spec
        return (tls.flag_value(s.http_args, "--scheduler-ssl-ca")
                or tls.flag_value(s.scheduler_args, "--ssl-certfile"))

    def _scheduler_ca_args(self) -> list[str]:
        ca = self.scheduler_ca()
        given = tls.flag_value(self.spec.http_args, "--scheduler-ssl-ca") is not None
        return [] if ca is None or given else ["--scheduler-ssl-ca", ca]

    def start_http(self) -> None:
        """(Re)starts http_svc; it follows the scheduler's readiness on its own."""
        self._spawn("http", "http_svc", self.http_args())

    def worker_args(self, i: int) -> list[str]:
        """Worker i's command line: its id, its device (if planned) and the common flags."""
        s = self.spec
        model = ["--model", s.model] if s.model else []
        device = ["--device", s.worker_devices[i]] if s.worker_devices else []
        return [*model, "--scheduler", self.control_address, "--host", INTERNAL_HOST,
                "--threads", str(self.threads_per_worker), "--worker-id", f"worker{i}",
                *device, "--log-level", s.log_level, *self.kv_store_args(), *s.worker_args]

    def kv_store_args(self) -> list[str]:
        """Workers save their KV to kvcache_svc's store, on by default (a later `--kv-store ""`
        in worker_args turns it off); a store on "any free port" has no address to give."""
        port = self.spec.kv_store_port
        if not port or "--no-kv-store" in self.spec.kvcache_args:
            return []
        return ["--kv-store", f"tcp://{INTERNAL_HOST}:{port}"]

    @property
    def threads_per_worker(self) -> int:
        """Every worker on this machine gets an equal share of its CPUs: each taking all of
        them would make their OpenMP threads wait for each other at every barrier."""
        s = self.spec
        return s.threads_per_worker or max(1, available_cpus() // (s.tp * s.pp * s.num_replicas))

    def scheduler_args(self) -> list[str]:
        """The scheduler's command line: clients (and metrics) on --host, the control listener
        and the ZMQ socket the workers answer on (--advertise-host) on the internal host."""
        s = self.spec
        model = ["--model", s.model] if s.model else []
        dtype = ["--dtype", s.dtype] if s.dtype else []
        return [*model, "--host", s.host, "--port", str(s.port), "--control-host", INTERNAL_HOST,
                "--control-port", str(s.control_port), "--advertise-host", INTERNAL_HOST, *dtype,
                "--tp", str(s.tp), "--pp", str(s.pp), "--metrics-port", str(s.metrics_port),
                "--kvcache", f"tcp://{INTERNAL_HOST}:{s.kv_plan_port}", "--log-level", s.log_level,
                *s.scheduler_args]

    def start_scheduler(self) -> None:
        """(Re)starts scheduler_svc; running workers register with a restarted one."""
        self._spawn("scheduler", "scheduler_svc", self.scheduler_args())

    def start_kvcache(self) -> None:
        """(Re)starts kvcache_svc on its fixed ports (a restart after a kill is a new
        instance: new epoch, no pools)."""
        s = self.spec
        self._spawn("kvcache", "kvcache_svc", [
            "--host", INTERNAL_HOST, "--plan-port", str(s.kv_plan_port), "--admin-port",
            str(s.kv_admin_port), "--events-port", str(s.kv_events_port),
            "--kv-store-port", str(s.kv_store_port),
            "--log-level", s.log_level, *s.kvcache_args])

    def add_worker(self, name: str, extra: Sequence[str] = ()) -> None:
        s = self.spec
        model = ["--model", s.model] if s.model else []
        self._spawn(name, "worker_svc", [*model, "--scheduler", self.control_address,
                                         "--host", INTERNAL_HOST,
                                         "--threads", str(self.threads_per_worker),
                                         "--worker-id", name, "--log-level", s.log_level,
                                         *self.kv_store_args(), *s.worker_args, *extra])

    def dead(self) -> dict[str, int]:
        """Children that exited, with their exit codes."""
        return {name: code for name, p in self.procs.items() if (code := p.poll()) is not None}

    def wait_ready(self, timeout_s: float) -> None:
        """Blocks until the scheduler reports a ready replica; raises if a child dies."""
        deadline = time.monotonic() + timeout_s
        ca = self.scheduler_ca()
        with (grpc.insecure_channel(self.address) if ca is None else
              grpc.secure_channel(self.address, tls.channel_credentials(ca))) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if dead := self.dead():
                    raise RuntimeError(f"service exited during start-up: {dead}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(
                        service="splitserve.v1.Generation"), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"cluster not ready within {timeout_s:.0f}s")

    def signal(self, name: str, sig: int) -> None:
        os.killpg(self.procs[name].pid, sig)

    def stop(self, grace_s: float = 15.0) -> dict[str, int]:
        """SIGTERM everyone (the HTTP API and workers first), SIGKILL what is left after
        `grace_s`."""
        order = sorted(self.procs, key=lambda n: (n != "http", not n.startswith("worker"),
                                                  n != "scheduler"))
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        codes: dict[str, int] = {}
        for name in order:
            p = self.procs[name]
            try:
                codes[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes[name] = p.wait()
        return codes
