"""TLS on the public listeners (the scheduler's client gRPC port, http_svc's HTTP API) and on
http_svc's channel to the scheduler: the flags' files checked at start, and the gRPC
credentials built from them. uvicorn takes the same two files as they are.

Internal listeners never use these: they stay on loopback or a private network, guarded by
the cluster token (services.cluster_token).
"""

from collections.abc import Sequence
from pathlib import Path

import grpc


def files_error(certfile: str | None, keyfile: str | None) -> str | None:
    """Why `--ssl-certfile`/`--ssl-keyfile` cannot be used (None: they can, or neither is
    set): one without the other, or a file that cannot be read."""
    if (certfile is None) != (keyfile is None):
        given, missing = (("--ssl-certfile", "--ssl-keyfile") if keyfile is None
                          else ("--ssl-keyfile", "--ssl-certfile"))
        return f"{given} needs {missing} too"
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None and (error := _unreadable(path)) is not None:
            return f"{flag} {path}: {error}"
    return None


def ca_error(flag: str, path: str | None) -> str | None:
    """Why a CA file flag cannot be used (None: it can, or it is not set)."""
    if path is None or (error := _unreadable(path)) is None:
        return None
    return f"{flag} {path}: {error}"


def _unreadable(path: str) -> str | None:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return exc.strerror or str(exc)
    if b"-----BEGIN " not in data:
        return "not a PEM file"
    return None


def server_credentials(certfile: str, keyfile: str) -> grpc.ServerCredentials:
    """A gRPC server's TLS credentials (no client certificates asked for: clients prove
    who they are with an API key)."""
    return grpc.ssl_server_credentials(
        [(Path(keyfile).read_bytes(), Path(certfile).read_bytes())])


def channel_credentials(ca_file: str | None) -> grpc.ChannelCredentials:
    """A gRPC client's TLS credentials trusting `ca_file` (None: the system's roots)."""
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca_file is None else Path(ca_file).read_bytes())


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value the last `flag V` or `flag=V` of a command line gives (None: none does).
    The launcher reads its children's TLS files so."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value
