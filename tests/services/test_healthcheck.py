"""services.healthcheck against a real grpc.health.v1 server and real files: exit 0 only when
healthy, 1 otherwise (never argparse's 2, which Docker reserves), one line printed."""

import os
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.healthcheck import main


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("splitserve.v1.Generation", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 1, lines
    return code, lines[0] if lines else ""


def test_liveness_serving(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, address) == (0, f"{address} service '': SERVING")


def test_readiness_not_serving(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, address, "--service", "splitserve.v1.Generation")
    assert code == 1 and line.endswith("NOT_SERVING")


def test_unknown_service(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, address, "--service", "nope")
    assert code == 1 and "NOT_FOUND" in line


def test_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:   # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, line = run(capsys, f"127.0.0.1:{port}", "--timeout", "1")
    assert code == 1 and "UNAVAILABLE" in line


def test_heartbeat_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "worker.alive"
    assert run(capsys, "--file", str(path))[0] == 1                   # not yet written
    path.touch()
    assert run(capsys, "--file", str(path), "--max-age", "15")[0] == 0
    old = time.time() - 60
    os.utime(path, (old, old))
    code, line = run(capsys, "--file", str(path), "--max-age", "15")
    assert code == 1 and "max 15s" in line


def test_usage_errors_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 1
    assert main(["127.0.0.1:1", "--file", "x"]) == 1
    capsys.readouterr()
