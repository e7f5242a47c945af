"""`splitserve up`'s flags as the processes it would start, without starting any: the device
each worker gets, the GPU flags passed through, and a refusal before anything starts when the
workers outnumber the GPUs; the control port the workers are sent to, and what `up` says about
the cluster token (that a chosen one is used, never its value); the service flags `up` passes
on to the service that defines them, and the ones it refuses. (tests/e2e/test_cli.py runs the
real thing.)"""

import subprocess
import sys
from pathlib import Path

import pytest

from services import cli, cluster_token
from services.launcher import DevicePlanError, ServiceProcesses

ROOT = Path(__file__).resolve().parents[2]


def up_args(*flags: str):  # type: ignore[no-untyped-def]
    return cli.parse_args(["up", *flags])


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
    assert up_args("--gpu-memory-utilization", "1").worker_args == [
        "--gpu-memory-utilization", "1"]


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


# ---------------------------------------------------------- flags passed on to the services


def test_up_passes_a_scheduler_flag_to_the_scheduler_and_a_worker_flag_to_the_workers() -> None:
    spec = cli.cluster_spec(up_args("--max-num-seqs", "8", "--replicas", "2",
                                    "--kv-cache-memory-gib=0.25", "--no-prefix-caching",
                                    "--enforce-eager"), num_gpus=0)
    assert spec.scheduler_args == ("--max-num-seqs", "8", "--no-prefix-caching")
    assert spec.worker_args == ("--kv-cache-memory-gib=0.25", "--enforce-eager")
    procs = ServiceProcesses(spec)
    assert procs.scheduler_args()[-3:] == ["--max-num-seqs", "8", "--no-prefix-caching"]
    for i in range(2):
        assert procs.worker_args(i)[-2:] == ["--kv-cache-memory-gib=0.25", "--enforce-eager"]
    # Nothing given: nothing passed on, so each service keeps its own default.
    spec = cli.cluster_spec(up_args(), num_gpus=0)
    assert spec.scheduler_args == spec.worker_args == () and spec.dtype is None
    assert "--dtype" not in ServiceProcesses(spec).scheduler_args()


def test_every_up_flag_the_docs_and_tests_use_still_parses() -> None:
    a = up_args("--model", "m.gguf", "--port", "6000", "--dtype", "float32", "--max-num-seqs",
                "4", "--max-num-batched-tokens", "512", "--num-kv-blocks", "64",
                "--block-size", "32", "--no-chunked-prefill", "--no-prefix-caching",
                "--kv-cache-memory-gib", "0.5", "--tp", "2", "--pp", "2", "--replicas", "1",
                "--no-async-scheduling", "--no-quant-kernels", "--metrics-port", "-1",
                "--control-port", "6100", "--cpu-level", "avx2", "--threads", "1",
                "--log-dir", "/tmp/x", "--device", "cpu", "--gpu-memory-utilization", "0.8",
                "--enforce-eager", "--no-int4-kernels", "--startup-timeout", "5")
    assert a.scheduler_args == ["--dtype", "float32", "--max-num-seqs", "4",
                                "--max-num-batched-tokens", "512", "--num-kv-blocks", "64",
                                "--block-size", "32", "--no-chunked-prefill",
                                "--no-prefix-caching", "--no-async-scheduling"]
    assert a.worker_args == ["--kv-cache-memory-gib", "0.5", "--no-quant-kernels",
                             "--cpu-level", "avx2", "--gpu-memory-utilization", "0.8",
                             "--enforce-eager", "--no-int4-kernels"]
    assert (a.model, a.port, a.tp, a.pp, a.metrics_port, a.control_port, a.threads) == (
        "m.gguf", 6000, 2, 2, -1, 6100, 1)


def test_a_flag_several_services_define_goes_to_each() -> None:
    parsers = cli.service_parsers()
    for p in parsers.values():
        p.add_flag("--shared-knob", type=int)
    forwarded = cli.forward_flags(["--shared-knob", "3", "--max-num-seqs", "2"], parsers)
    assert forwarded == {"scheduler_svc": ["--shared-knob", "3", "--max-num-seqs", "2"],
                         "worker_svc": ["--shared-knob", "3"],
                         "kvcache_svc": ["--shared-knob", "3"],
                         "http_svc": ["--shared-knob", "3"]}


def test_kv_store_flags_go_to_kvcache_and_no_store_means_no_saving() -> None:
    """`up --no-kv-store` reaches kvcache_svc, and the workers then get no store address;
    the store's tiers are kvcache_svc's flags too; its port is up's own (--port + 6)."""
    args = cli.parse_args(["up", "--no-kv-store", "--kv-store-memory-gib", "1"])
    assert args.kvcache_args == ["--no-kv-store", "--kv-store-memory-gib", "1"]
    procs = ServiceProcesses(cli.cluster_spec(args, 0))
    assert "--kv-store" not in procs.worker_args(0)
    default = ServiceProcesses(cli.cluster_spec(cli.parse_args(["up"]), 0))
    assert "--kv-store" in default.worker_args(0)
    with pytest.raises(cli.ForwardError, match="--kv-store-port: splitserve up sets it"):
        cli.forward_flags(["--kv-store-port", "9"], cli.service_parsers())


@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag"], "'--no-such-flag' is no flag of splitserve up, scheduler_svc, "
                         "worker_svc, kvcache_svc or http_svc (see splitserve up --help)"),
    (["--max-num-seqs", "4", "stray"], "'stray' is no flag of splitserve up"),
    (["--kvcache", "tcp://elsewhere:1"], "--kvcache: splitserve up sets it itself"),
    (["--worker-id=w"], "--worker-id: splitserve up sets it itself"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
])
def test_up_refuses_a_flag_it_cannot_pass_on_before_starting_anything(
        flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ServiceProcesses, "start", lambda self: pytest.fail("started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["up", "--device", "cpu", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "splitserve up: error: " in err and message in err


def test_generate_still_refuses_an_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "hi", "--max-num-seqs", "4"])
    assert "unrecognized arguments: --max-num-seqs 4" in capsys.readouterr().err


def test_up_help_names_the_flags_it_passes_on(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["up", "--help"])
    out = capsys.readouterr().out
    scheduler, worker = out.split("forwarded to scheduler_svc:")[1].split(
        "forwarded to worker_svc:")
    assert "--max-num-seqs" in scheduler and "--no-chunked-prefill" in scheduler
    assert "--gpu-memory-utilization" in worker and "--enforce-eager" in worker
    assert "--kvcache " not in out and "--worker-id" not in out   # the launcher's own
