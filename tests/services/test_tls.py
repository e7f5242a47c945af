"""TLS files (services.tls): the flags' files checked at start with a message naming the
flag, a flag's value read from a child's command line, and the launcher trusting the
scheduler's TLS port (its readiness probe and http_svc's channel) with the right CA."""

from pathlib import Path

from services import tls
from services.launcher import ClusterSpec, ServiceProcesses
from tests.services.tls_files import self_signed


def test_tls_flag_files(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    assert tls.files_error(None, None) is None
    assert tls.files_error(str(cert), str(key)) is None
    assert tls.files_error(str(cert), None) == "--ssl-certfile needs --ssl-keyfile too"
    assert tls.files_error(None, str(key)) == "--ssl-keyfile needs --ssl-certfile too"
    missing = tls.files_error(str(tmp_path / "nope.crt"), str(key))
    assert missing is not None and missing.startswith("--ssl-certfile ")
    assert "nope.crt" in missing
    (tmp_path / "plain.txt").write_text("not a certificate")
    assert tls.ca_error("--scheduler-ssl-ca", str(tmp_path / "plain.txt")) == (
        f"--scheduler-ssl-ca {tmp_path / 'plain.txt'}: not a PEM file")
    assert tls.ca_error("--scheduler-ssl-ca", str(cert)) is None
    assert tls.ca_error("--scheduler-ssl-ca", None) is None


def test_a_flags_value_on_a_command_line() -> None:
    args = ["--port", "1", "--ssl-certfile", "a.pem", "--x", "--ssl-certfile=b.pem"]
    assert tls.flag_value(args, "--ssl-certfile") == "b.pem"
    assert tls.flag_value(args[:4], "--ssl-certfile") == "a.pem"
    assert tls.flag_value(["--ssl-certfile"], "--ssl-certfile") is None
    assert tls.flag_value(args, "--ssl-keyfile") is None


def test_the_launcher_trusts_the_schedulers_certificate() -> None:
    plain = ServiceProcesses(ClusterSpec(http_port=8001))
    assert plain.scheduler_ca() is None and "--scheduler-ssl-ca" not in plain.http_args()
    own = ServiceProcesses(ClusterSpec(http_port=8001, scheduler_args=(
        "--ssl-certfile", "s.crt", "--ssl-keyfile", "s.key")))
    assert own.scheduler_ca() == "s.crt"
    assert own.http_args()[-2:] == ["--scheduler-ssl-ca", "s.crt"]
    given = ServiceProcesses(ClusterSpec(
        http_port=8001, scheduler_args=("--ssl-certfile", "s.crt", "--ssl-keyfile", "s.key"),
        http_args=("--scheduler-ssl-ca", "ca.crt")))
    assert given.scheduler_ca() == "ca.crt"
    assert given.http_args().count("--scheduler-ssl-ca") == 1
