"""services.healthcheck against services that serve TLS (a real gRPC server and a real HTTP
server with a self-signed certificate): the probe speaks TLS when the service's certificate
variable is set (or --ssl-certfile), trusting that certificate only; plaintext otherwise."""

import ssl
import subprocess
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.healthcheck import GRPC_TLS_ENV, HTTP_TLS_ENV, main
from services.tls import server_credentials
from tests.services.test_healthcheck import address as plain_address  # noqa: F401 - fixture
from tests.services.test_healthcheck_http import Handler
from tests.services.tls_files import self_signed


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(directory)
    stranger, _ = self_signed(directory, "stranger")
    return {"cert": cert, "key": key, "stranger": stranger}


@pytest.fixture(scope="module")
def tls_address(certs: dict[str, Path]) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port(
        "127.0.0.1:0", server_credentials(str(certs["cert"]), str(certs["key"])))
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("splitserve.v1.Generation", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def tls_base(certs: dict[str, Path]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs["cert"], certs["key"])
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(autouse=True)
def no_tls_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GRPC_TLS_ENV, raising=False)
    monkeypatch.delenv(HTTP_TLS_ENV, raising=False)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return code, lines[0]


def test_grpc_over_tls_with_the_schedulers_variable(
        tls_address: str, certs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(GRPC_TLS_ENV, str(certs["cert"]))
    assert run(capsys, tls_address) == (0, f"{tls_address} service '': SERVING")
    code, line = run(capsys, tls_address, "--service", "splitserve.v1.Generation")
    assert code == 1 and line.endswith("NOT_SERVING")


def test_grpc_over_tls_with_the_flag(tls_address: str, certs: dict[str, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, tls_address, "--ssl-certfile", str(certs["cert"]))
    assert code == 0 and line.endswith("SERVING")


def test_a_tls_port_probed_in_plaintext_is_unhealthy(
        tls_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, tls_address, "--timeout", "1")
    assert code == 1 and "SERVING" not in line


def test_a_certificate_other_than_the_services_is_refused(
        tls_address: str, certs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, tls_address, "--ssl-certfile", str(certs["stranger"]))
    assert code == 1 and "TLS:" in line and "certificate verify failed" in line


def test_http_over_tls_with_http_svcs_variable(
        tls_base: str, certs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(HTTP_TLS_ENV, str(certs["cert"]))
    # compose's test line names http://; the probe asks https:// since the service serves TLS
    assert run(capsys, "--http", f"http://{tls_base}/version") == (
        0, f"https://{tls_base}/version: HTTP 200")
    assert run(capsys, "--http", f"https://{tls_base}/health") == (
        1, f"https://{tls_base}/health: HTTP 503")


def test_an_https_service_probed_in_plaintext_is_unhealthy(
        tls_base: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run(capsys, "--http", f"http://{tls_base}/version", "--timeout", "2")
    assert code == 1 and "HTTP 200" not in line


def test_each_form_reads_its_own_services_variable(
        plain_address: str, certs: dict[str, Path],  # noqa: F811 - the fixture
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """http_svc's certificate does not turn the gRPC probe to TLS: plaintext still works."""
    monkeypatch.setenv(HTTP_TLS_ENV, str(certs["cert"]))
    assert run(capsys, plain_address) == (0, f"{plain_address} service '': SERVING")


def test_an_unreadable_certificate_file_is_named(
        tls_address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.crt"
    code, line = run(capsys, tls_address, "--ssl-certfile", str(missing))
    assert code == 1 and line.startswith(f"TLS certificate {missing}:")


def ca_issued(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) of a server named api.example.com only, issued by a CA of its own;
    the certificate file holds the server's certificate alone, not the CA's."""
    ca_cert, ca_key = self_signed(directory, "ca")
    key, csr, cert = directory / "leaf.key", directory / "leaf.csr", directory / "leaf.crt"
    extensions = directory / "leaf.ext"
    extensions.write_text("subjectAltName=DNS:api.example.com\n")
    for argv in (["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                  "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=api.example.com"],
                 ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey",
                  str(ca_key), "-CAcreateserial", "-out", str(cert), "-days", "1",
                  "-extfile", str(extensions)]):
        subprocess.run(argv, check=True, capture_output=True)
    return cert, key


def test_a_ca_issued_certificate_for_another_name_is_trusted_as_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The probe dials 127.0.0.1, which the certificate does not name, and has not its CA."""
    cert, key = ca_issued(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(str(cert), str(key)))
    server.start()
    try:
        code, line = run(capsys, f"127.0.0.1:{port}", "--ssl-certfile", str(cert))
    finally:
        server.stop(grace=None)
    assert (code, line) == (0, f"127.0.0.1:{port} service '': SERVING")
