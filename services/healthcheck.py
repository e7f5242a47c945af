"""`python -m services.healthcheck`: the probe that compose.yaml's healthchecks run.

Three forms, each printing one line and exiting 0 when healthy, 1 otherwise:

    python -m services.healthcheck HOST:PORT [--service NAME] [--timeout S]
        grpc.health.v1 Check on a service's gRPC port. The empty service name (the default)
        is liveness: SERVING while the process runs. A named service such as
        `splitserve.v1.Generation` is readiness: SERVING only while a replica is ready.
    python -m services.healthcheck --file PATH --max-age S
        For workers, which serve no gRPC: the worker touches PATH on every successful heartbeat
        (`--health-file`), so a file modified within S seconds means the scheduler still
        answers it.
    python -m services.healthcheck --http URL [--timeout S]
        An HTTP GET, for the HTTP API (http_svc): healthy on a 2xx answer. Its /version is
        liveness (the process serves HTTP), its /health readiness (a replica can serve).

Called by the container engine inside each container, and by tests/compose/test_config.py.
"""

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check_grpc(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    """(healthy, one-line status) of one grpc.health.v1 Check."""
    label = f"{address} service {service!r}"
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        return False, f"{label}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, f"{label}: {status}"


def check_file(path: Path, max_age_s: float) -> tuple[bool, str]:
    """(healthy, one-line status): the file exists and was modified within `max_age_s`."""
    try:
        age_s = time.time() - path.stat().st_mtime
    except OSError as exc:
        return False, f"{path}: {exc.strerror or exc}"
    return age_s <= max_age_s, f"{path}: modified {age_s:.1f}s ago (max {max_age_s:g}s)"


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    """(healthy, one-line status) of one HTTP GET: healthy on a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:   # refused, timed out, a malformed URL
        return False, f"{url}: {getattr(exc, 'reason', None) or exc}"
    return 200 <= status < 300, f"{url}: HTTP {status}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.healthcheck",
                                description="exit 0 when a splitserve service is healthy")
    p.add_argument("address", nargs="?", help="gRPC HOST:PORT to Check")
    p.add_argument("--service", default="",
                   help="health service name ('' = liveness; e.g. splitserve.v1.Generation)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for the Check call")
    p.add_argument("--file", type=Path, help="heartbeat file to check instead of gRPC")
    p.add_argument("--http", metavar="URL", help="HTTP URL to GET instead of gRPC (2xx: healthy)")
    p.add_argument("--max-age", type=float, default=15.0,
                   help="seconds since the heartbeat file's last modification")
    a = p.parse_args(argv)
    if sum(x is not None for x in (a.address, a.file, a.http)) != 1:
        p.error("give one of HOST:PORT, --file PATH or --http URL")
    if a.timeout <= 0 or a.max_age <= 0:
        p.error("--timeout and --max-age must be > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except SystemExit as exc:  # argparse's usage error is 2, which Docker reserves
        return 1 if exc.code == 2 else int(exc.code or 0)
    if a.file is not None:
        healthy, line = check_file(a.file, a.max_age)
    elif a.http is not None:
        healthy, line = check_http(a.http, a.timeout)
    else:
        healthy, line = check_grpc(a.address, a.service, a.timeout)
    print(line, flush=True)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
