"""`splitserve up` and the HTTP front end, without starting anything: http_svc on
--http-port (8000 by default, -1: none) beside the scheduler's client port on --host, its own
flags forwarded to it, a port clash refused before anything starts; the scheduler's metrics
off 8000 (port + 5 under `up`, 50056 standalone)."""

import pytest

from services import cli
from services.flags import FlagParser
from services.launcher import ServiceProcesses
from services.service_flags import add_http_flags, add_scheduler_flags


def processes(*flags: str) -> ServiceProcesses:
    return ServiceProcesses(cli.cluster_spec(cli.parse_args(["up", *flags]), num_gpus=0))


def test_up_starts_the_http_api_on_8000_beside_the_scheduler() -> None:
    procs = processes()
    assert procs.spec.http_port == 8000 and procs.http_address == "127.0.0.1:8000"
    assert procs.spec.metrics_port == 50056          # port + 5, off the HTTP API's port
    assert procs.http_args() == ["--host", "127.0.0.1", "--port", "8000",
                                 "--scheduler", "127.0.0.1:50051", "--log-level", "info",
                                 "--scheduler-metrics", "http://127.0.0.1:50056/metrics"]


def test_on_every_interface_it_still_reaches_the_scheduler_on_loopback() -> None:
    procs = processes("--host", "0.0.0.0", "--port", "6000", "--http-port", "9000")
    assert procs.http_args()[:6] == ["--host", "0.0.0.0", "--port", "9000",
                                     "--scheduler", "127.0.0.1:6000"]


def test_minus_one_starts_no_http_api() -> None:
    procs = processes("--http-port", "-1")
    assert procs.spec.http_port is None and procs.http_address is None


def test_http_flags_are_forwarded_to_it() -> None:
    a = cli.parse_args(["up", "--max-body-bytes", "4096", "--drain-timeout", "5"])
    assert a.http_args == ["--max-body-bytes", "4096", "--drain-timeout", "5"]
    assert a.scheduler_args == ["--drain-timeout", "5"]     # both services define it
    assert processes("--max-body-bytes", "4096").http_args()[-2:] == ["--max-body-bytes",
                                                                       "4096"]
    # vLLM's tool-calling flags, as `vllm serve` takes them.
    a = cli.parse_args(["serve", "m.gguf", "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"])
    assert a.http_args == ["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                           "--reasoning-parser", "qwen3"]


@pytest.mark.parametrize("flags, clash", [
    (["--http-port", "50051"], "--http-port 50051 is also --port"),
    (["--port", "7995"], "--http-port 8000 is also --metrics-port"),
    (["--http-port", "50053"], "--http-port 50053 is also --port + 2 (kvcache plan)"),
])


def test_a_port_clash_is_refused_before_anything_starts(
        flags: list[str], clash: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ServiceProcesses, "start", lambda self: pytest.fail("started"))
    assert cli.main(["up", "--device", "cpu", *flags]) == 2
    assert clash in capsys.readouterr().err


def test_standalone_defaults_do_not_collide() -> None:
    scheduler = add_scheduler_flags(FlagParser(environ={})).parse_args([])
    http = add_http_flags(FlagParser(environ={})).parse_args([])
    assert (http.port, scheduler.metrics_port) == (8000, 50056)
    assert http.scheduler == f"127.0.0.1:{scheduler.port}"
