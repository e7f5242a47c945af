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

TLS: where the probed service serves TLS, so does the probe. It reads the variable the
service reads (services.service_flags.add_edge_flags): SPLITSERVE_SSL_CERTFILE for the gRPC
form (the scheduler's client port), SPLITSERVE_HTTP_SSL_CERTFILE for --http (http_svc; an
`http://` URL is then probed as `https://`); `--ssl-certfile` overrides either. The probe
trusts exactly that certificate file, the server's own, and checks no host name: it dials
loopback or a service name the certificate need not list, and what it proves is that the
service answers with the certificate it was given (a stale or wrong one reads unhealthy).
Nothing secret travels (health calls carry no API key). gRPC's Python client cannot trust a
certificate without a name check, so the gRPC probe speaks TLS through Python's `ssl` and
relays its plaintext HTTP/2 over a loopback port to a gRPC channel.

Called by the container engine inside each container, and by tests/compose/test_config.py.
"""

import argparse
import asyncio
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.flags import ENV_PREFIX

GRPC_TLS_ENV = ENV_PREFIX + "SSL_CERTFILE"          # the scheduler's client port
HTTP_TLS_ENV = ENV_PREFIX + "HTTP_SSL_CERTFILE"     # http_svc


def probe_context(certfile: str, alpn: str) -> ssl.SSLContext:
    """TLS that trusts the service's own certificate file (each certificate in it an
    anchor, so a CA-issued one works without its root) and checks no host name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False       # the probe's address is not the certificate's name
    context.load_verify_locations(cafile=certfile)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.set_alpn_protocols([alpn])
    return context


def check_grpc(address: str, service: str, timeout_s: float,
               tls: ssl.SSLContext | None = None) -> tuple[bool, str]:
    """(healthy, one-line status) of one grpc.health.v1 Check; over `tls` when given."""
    label = f"{address} service {service!r}"
    if tls is not None:
        return asyncio.run(_check_grpc_tls(address, service, timeout_s, tls, label))
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        return False, f"{label}: {exc.code().name}: {exc.details()}"
    return _serving(response, label)


def _serving(response: health_pb2.HealthCheckResponse, label: str) -> tuple[bool, str]:
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, f"{label}: {status}"


async def _check_grpc_tls(address: str, service: str, timeout_s: float, tls: ssl.SSLContext,
                          label: str) -> tuple[bool, str]:
    """The Check through a loopback relay into a TLS connection made by `ssl`. The first
    connection is made before the call, so a refused certificate is reported as such."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(
            asyncio.open_connection(host, int(port), ssl=tls, server_hostname=host), timeout_s)

    try:
        first = [await connect()]
    except (OSError, ValueError, TimeoutError) as exc:   # ssl.SSLError is an OSError
        return False, f"{label}: TLS: {exc or type(exc).__name__}"

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = first.pop() if first else await connect()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (asyncio.CancelledError, OSError, TimeoutError):
            writer.close()       # the probe is over (asyncio.run cancels what is left)

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        relay_port = server.sockets[0].getsockname()[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}") as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        return False, f"{label}: {exc.code().name}: {exc.details()}"
    finally:
        server.close()
        for _, writer in first:
            writer.close()
    return _serving(response, label)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def check_file(path: Path, max_age_s: float) -> tuple[bool, str]:
    """(healthy, one-line status): the file exists and was modified within `max_age_s`."""
    try:
        age_s = time.time() - path.stat().st_mtime
    except OSError as exc:
        return False, f"{path}: {exc.strerror or exc}"
    return age_s <= max_age_s, f"{path}: modified {age_s:.1f}s ago (max {max_age_s:g}s)"


def check_http(url: str, timeout_s: float,
               tls: ssl.SSLContext | None = None) -> tuple[bool, str]:
    """(healthy, one-line status) of one HTTP GET: healthy on a 2xx status. With `tls`, an
    `http://` URL is asked as `https://`."""
    if tls is not None and url.startswith("http://"):
        url = "https://" + url[len("http://"):]
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=tls) as response:
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
    p.add_argument("--ssl-certfile", metavar="FILE",
                   help=f"the service's TLS certificate: probe over TLS trusting it (default: "
                        f"{GRPC_TLS_ENV}, or {HTTP_TLS_ENV} with --http; unset: plaintext)")
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
    else:
        certfile = a.ssl_certfile or os.environ.get(HTTP_TLS_ENV if a.http else GRPC_TLS_ENV)
        try:
            tls = None if not certfile else probe_context(certfile, "http/1.1" if a.http else "h2")
        except (OSError, ssl.SSLError) as exc:
            print(f"TLS certificate {certfile}: {exc}", flush=True)
            return 1
        if a.http is not None:
            healthy, line = check_http(a.http, a.timeout, tls)
        else:
            healthy, line = check_grpc(a.address, a.service, a.timeout, tls)
    print(line, flush=True)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
