"""`splitserve up`'s flags as the processes it would start, without starting any: the device
each worker gets, the GPU flags passed through, and a refusal before anything starts when the
workers outnumber the GPUs. (tests/e2e/test_cli.py runs the real thing.)"""

import subprocess
import sys
from pathlib import Path

import pytest

from services import cli
from services.launcher import DevicePlanError, ServiceProcesses

ROOT = Path(__file__).resolve().parents[2]


def up_args(*flags: str):  # type: ignore[no-untyped-def]
    return cli.build_parser().parse_args(["up", *flags])


def test_cpu_by_default_without_a_gpu() -> None:
    spec = cli.cluster_spec(up_args("--replicas", "2"), num_gpus=0)
    assert spec.worker_devices == ("cpu", "cpu")
    args = ServiceProcesses(spec).worker_args(1)
    assert args[args.index("--device") + 1] == "cpu"
    assert "--gpu-memory-utilization" not in args and "--enforce-eager" not in args


def test_cuda_gives_worker_i_gpu_i_and_passes_the_gpu_flags() -> None:
    spec = cli.cluster_spec(up_args("--device", "cuda", "--tp", "2", "--replicas", "2",
                                    "--gpu-memory-utilization", "0.75", "--enforce-eager"),
                            num_gpus=4)
    assert spec.worker_devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    procs = ServiceProcesses(spec)
    for i in range(4):
        args = procs.worker_args(i)
        assert args[args.index("--device") + 1] == f"cuda:{i}"
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.75"
        assert "--enforce-eager" in args


def test_auto_and_one_named_gpu() -> None:
    assert cli.cluster_spec(up_args(), num_gpus=2).worker_devices == ("cuda:0",)
    assert cli.cluster_spec(up_args("--device", "cuda:1"), num_gpus=2).worker_devices == (
        "cuda:1",)
    with pytest.raises(DevicePlanError, match="4 workers, but torch sees 2"):
        cli.cluster_spec(up_args("--pp", "2", "--replicas", "2"), num_gpus=2)


def test_gpu_memory_utilization_must_be_a_fraction(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            up_args("--gpu-memory-utilization", bad)
        assert "is not in (0, 1]" in capsys.readouterr().err
    assert up_args("--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0


def test_up_refuses_more_workers_than_gpus_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "visible_gpus", lambda: 2)
    monkeypatch.setattr(ServiceProcesses, "start", lambda self: pytest.fail("started"))
    assert cli.main(["up", "--device", "cuda", "--tp", "2", "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert "tp 2 x pp 2 x 1 replica(s) = 4 workers, but torch sees 2 GPU(s)" in err
    assert "each worker needs its own GPU" in err


def test_the_cli_does_not_import_torch_until_a_gpu_may_be_wanted() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, services.cli; "
                          "print('torch' in sys.modules)"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
