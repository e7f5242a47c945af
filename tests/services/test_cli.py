"""`splitserve up`'s flags as the processes it would start, without starting any: the device
each worker gets, the GPU flags passed through, and a refusal before anything starts when the
workers outnumber the GPUs; the control port the workers are sent to, and what `up` says about
the cluster token (that a chosen one is used, never its value). (tests/e2e/test_cli.py runs the
real thing.)"""

import subprocess
import sys
from pathlib import Path

import pytest

from services import cli, cluster_token
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


def test_control_port_defaults_beside_the_client_port() -> None:
    assert cli.cluster_spec(up_args(), num_gpus=0).control_port == 50052
    assert cli.cluster_spec(up_args("--port", "6000"), num_gpus=0).control_port == 6001
    spec = cli.cluster_spec(up_args("--control-port", "7100"), num_gpus=0)
    worker = ServiceProcesses(spec).worker_args(0)
    assert worker[worker.index("--scheduler") + 1] == "127.0.0.1:7100"


def up_until_a_service_exits(monkeypatch: pytest.MonkeyPatch) -> int:
    """`splitserve up` with nothing started: the first check finds a service gone, so it
    prints what it prints at start and returns 1."""
    monkeypatch.setattr("signal.signal", lambda *args: None)
    monkeypatch.setattr(ServiceProcesses, "start", lambda self: None)
    monkeypatch.setattr(ServiceProcesses, "dead", lambda self: {"kvcache": 2})
    monkeypatch.setattr(ServiceProcesses, "stop", lambda self, grace_s=0.0: {})
    return cli.main(["up", "--device", "cpu"])


def test_up_says_nothing_of_a_token_it_generated(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(cluster_token.ENV, raising=False)
    monkeypatch.setattr(cluster_token, "generate", lambda: "f" * 64)
    assert up_until_a_service_exits(monkeypatch) == 1
    err = capsys.readouterr().err
    assert "control on 127.0.0.1:50052" in err
    assert "token" not in err.lower() and "f" * 16 not in err


def test_up_names_a_token_that_was_set_but_never_shows_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(cluster_token.ENV, "operator-secret-0123456789")
    assert up_until_a_service_exits(monkeypatch) == 1
    err = capsys.readouterr().err
    assert f"cluster token from {cluster_token.ENV}" in err
    assert "operator-secret" not in err


def test_up_refuses_a_short_token_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(cluster_token.ENV, "tiny-secret")
    monkeypatch.setattr(ServiceProcesses, "start", lambda self: pytest.fail("started"))
    assert cli.main(["up", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert cluster_token.ENV in err and "shorter than" in err and "tiny-secret" not in err
