"""The local launcher: its split of this machine's CPUs among the workers it starts, the GPU
it gives each worker (one of its own, or a refusal before anything starts), and the control
plane's wiring: workers on the scheduler's loopback control port, one cluster token for all."""

import re
import subprocess

import pytest

from services import cluster_token
from services.cpus import available_cpus
from services.launcher import ClusterSpec, DevicePlanError, ServiceProcesses, plan_devices


def test_workers_share_the_cpus_instead_of_each_taking_all() -> None:
    cpus = available_cpus()
    assert ServiceProcesses(ClusterSpec()).threads_per_worker == cpus
    two = ServiceProcesses(ClusterSpec(tp=2))
    assert two.threads_per_worker == max(1, cpus // 2)
    many = ServiceProcesses(ClusterSpec(pp=2, num_replicas=4 * cpus))
    assert many.threads_per_worker == 1
    assert ServiceProcesses(ClusterSpec(tp=2, threads_per_worker=3)).threads_per_worker == 3


# ---------------------------------------------------------------- one GPU per worker


@pytest.mark.parametrize("device, tp, pp, replicas, gpus, expected", [
    ("cpu", 2, 1, 2, 8, ("cpu",) * 4),                 # cpu even where GPUs are
    ("auto", 1, 1, 2, 0, ("cpu", "cpu")),              # auto without a GPU: the CPU
    ("auto", 2, 1, 1, 4, ("cuda:0", "cuda:1")),        # auto with GPUs: one each
    ("cuda", 2, 2, 2, 8, tuple(f"cuda:{i}" for i in range(8))),
    ("cuda:3", 1, 1, 1, 4, ("cuda:3",)),
])
def test_plan_devices_gives_each_worker_its_own_gpu(device: str, tp: int, pp: int,
                                                    replicas: int, gpus: int,
                                                    expected: tuple[str, ...]) -> None:
    assert plan_devices(device, tp, pp, replicas, gpus) == expected


@pytest.mark.parametrize("device, tp, pp, replicas, gpus, message", [
    ("cuda", 2, 2, 2, 4, "tp 2 x pp 2 x 2 replica(s) = 8 workers, but torch sees 4 GPU(s)"),
    ("auto", 1, 1, 3, 2, "3 workers, but torch sees 2 GPU(s)"),
    ("cuda", 1, 1, 1, 0, "torch sees no CUDA GPU"),
    ("cuda:0", 1, 1, 1, 0, "torch sees no CUDA GPU"),
    ("cuda:4", 1, 1, 1, 4, "torch sees 4 GPU(s), cuda:0..cuda:3"),
    ("cuda:1", 2, 1, 1, 4, "names one GPU, but tp 2 x pp 1 x 1 replica(s) = 2 workers"),
    ("gpu", 1, 1, 1, 4, "expected auto, cpu, cuda or cuda:N"),
    ("cuda:x", 1, 1, 1, 4, "expected auto, cpu, cuda or cuda:N"),
])
def test_plan_devices_refuses_what_does_not_fit(device: str, tp: int, pp: int, replicas: int,
                                                gpus: int, message: str) -> None:
    with pytest.raises(DevicePlanError, match=re.escape(message)):
        plan_devices(device, tp, pp, replicas, gpus)


def test_each_worker_is_started_on_its_planned_device() -> None:
    spec = ClusterSpec(model="m.gguf", tp=2, num_replicas=2, threads_per_worker=2,
                       worker_devices=plan_devices("cuda", 2, 1, 2, 4),
                       worker_args=("--gpu-memory-utilization", "0.8", "--enforce-eager"))
    procs = ServiceProcesses(spec)
    for i in range(4):
        args = procs.worker_args(i)
        assert args[args.index("--device") + 1] == f"cuda:{i}"
        assert args[args.index("--worker-id") + 1] == f"worker{i}"
        assert args[-3:] == ["--gpu-memory-utilization", "0.8", "--enforce-eager"]
    # Nothing planned: the worker's own default (its --device / SPLITSERVE_DEVICE).
    assert "--device" not in ServiceProcesses(ClusterSpec()).worker_args(0)


# ------------------------------------------------------- the control plane and its token


Children = list[tuple[list[str], dict[str, str]]]   # (argv, environment) per spawned child


class Spawned:
    """Stands in for subprocess.Popen: records each child's command and environment."""

    children: Children = []

    def __init__(self, args: list[str], env: dict[str, str], **kwargs: object) -> None:
        self.children.append((args, env))

    def poll(self) -> int | None:
        return None


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Children:
    monkeypatch.delenv(cluster_token.ENV, raising=False)
    monkeypatch.setattr(Spawned, "children", [])
    monkeypatch.setattr(subprocess, "Popen", Spawned)
    return Spawned.children


def tokens_of(children: Children) -> set[str]:
    return {env[cluster_token.ENV] for _, env in children}


def test_one_generated_token_for_every_child_and_every_restart(spawned: Children) -> None:
    procs = ServiceProcesses(ClusterSpec(tp=2))
    procs.start()
    procs.start_scheduler()                      # a restarted scheduler ...
    procs.start_kvcache()
    procs.add_worker("extra")                    # ... and an added worker rejoin with it
    modules = [args[2] for args, _ in spawned]
    assert modules == ["kvcache_svc", "scheduler_svc", "worker_svc", "worker_svc",
                       "scheduler_svc", "kvcache_svc", "worker_svc"]
    (token,) = tokens_of(spawned)
    assert len(token) == 64 and not procs.token_chosen
    # Each set of processes is its own cluster, with its own secret.
    assert ServiceProcesses(ClusterSpec()).cluster_token != token


def test_a_token_that_was_set_is_passed_as_is(spawned: Children,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cluster_token.ENV, "from-the-environment-0123")
    procs = ServiceProcesses(ClusterSpec())
    procs.start()
    assert tokens_of(spawned) == {"from-the-environment-0123"} and procs.token_chosen
    spawned.clear()
    ServiceProcesses(ClusterSpec(env={cluster_token.ENV: "from-the-spec-0123456"})).start()
    assert tokens_of(spawned) == {"from-the-spec-0123456"}   # the spec's wins
    monkeypatch.setenv(cluster_token.ENV, "")                 # empty: as if unset
    procs = ServiceProcesses(ClusterSpec())
    assert len(procs.cluster_token) == 64 and not procs.token_chosen


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_workers_register_on_the_schedulers_loopback_control_port(spawned: Children) -> None:
    """Clients may come from anywhere (`host` 0.0.0.0); the internal plane stays on loopback."""
    procs = ServiceProcesses(ClusterSpec(host="0.0.0.0", port=7000, control_port=7001,
                                         kv_plan_port=7002))
    procs.start()
    procs.add_worker("extra")
    (kvcache, _), (scheduler, _), (worker, _), (extra, _) = spawned
    assert flag(scheduler, "--host") == "0.0.0.0" and flag(scheduler, "--port") == "7000"
    assert procs.address == "0.0.0.0:7000"
    assert flag(scheduler, "--control-host") == "127.0.0.1"
    assert flag(scheduler, "--control-port") == "7001"
    assert flag(scheduler, "--advertise-host") == "127.0.0.1"      # its ZMQ socket
    assert flag(scheduler, "--kvcache") == "tcp://127.0.0.1:7002"
    assert flag(kvcache, "--host") == "127.0.0.1"
    for args in (worker, extra):
        assert flag(args, "--scheduler") == "127.0.0.1:7001"
        assert flag(args, "--host") == "127.0.0.1"                 # its step socket
