"""The local launcher: its split of this machine's CPUs among the workers it starts, and the
GPU it gives each worker (one of its own, or a refusal before anything starts)."""

import re

import pytest

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
