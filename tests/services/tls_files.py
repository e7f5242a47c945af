"""A self-signed certificate for the TLS tests, made on the fly with the `openssl` command (the
`cryptography` package is not installed): valid for localhost and 127.0.0.1, one day."""

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(directory: Path, name: str = "server") -> tuple[Path, Path]:
    """(certificate, private key) PEM files in `directory`; the certificate is its own CA."""
    if shutil.which("openssl") is None:
        pytest.fail("the TLS tests need the openssl command")
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True)
    return cert, key
