"""`splitserve generate --ssl-ca FILE` (services.cli) against a real gRPC server serving TLS
with a self-signed certificate: trusted, the completion streams; without the flag (plaintext)
or trusting another certificate, the call fails with exit 1; an unreadable file is named."""

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services import cli
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc
from services.tls import server_credentials
from tests.services.tls_files import self_signed


class OneChunk(generation_pb2_grpc.GenerationServicer):
    def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802 - the proto's
                 context: grpc.ServicerContext) -> Iterator[generation_pb2.GenerateResponse]:
        yield generation_pb2.GenerateResponse(token_ids=[3, 4], text="ok",
                                              finish_reason="stop")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(address, the server's certificate, another certificate)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(directory)
    stranger, _ = self_signed(directory, "stranger")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(OneChunk(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(str(cert), str(key)))
    server.start()
    yield f"127.0.0.1:{port}", cert, stranger
    server.stop(grace=None)


def generate(*extra: str) -> int:
    return cli.main(["generate", "hi", "--json", "--timeout", "5", *extra])


def test_generate_over_tls_trusting_the_servers_certificate(
        served: tuple[str, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    address, cert, _ = served
    assert generate("--address", address, "--ssl-ca", str(cert)) == 0
    assert capsys.readouterr().out.strip() == '{"token_ids": [3, 4], "finish_reason": "stop"}'


def test_plaintext_or_another_certificate_fails(
        served: tuple[str, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    address, _, stranger = served
    assert generate("--address", address) == 1
    assert "error: UNAVAILABLE" in capsys.readouterr().err
    assert generate("--address", address, "--ssl-ca", str(stranger)) == 1
    assert "error: UNAVAILABLE" in capsys.readouterr().err


def test_an_unreadable_ca_file_is_named(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.crt"
    assert generate("--ssl-ca", str(missing)) == 1
    assert capsys.readouterr().err.startswith(f"error: --ssl-ca {missing}: ")
