"""The cluster secret: what a process must present to act on the internal control plane.

Every member of a cluster (scheduler, kvcache_svc, workers) is started with the same
`SPLITSERVE_CLUSTER_TOKEN` (`splitserve up` generates one per cluster; compose requires it).

- gRPC control calls (worker registration and heartbeats on the scheduler's control
  listener, kvcache_svc's admin service) carry it as metadata (`x-splitserve-token`);
  `TokenInterceptor` refuses a call without it UNAUTHENTICATED and logs the peer (once per
  peer and interval, with a count: services.refusal_log). Health checks stay open
  (container healthchecks carry no secret; they reveal only liveness).
- Every ZMQ listener admits only peers that present a secret derived from the token at the
  handshake (ZMQ PLAIN checked by a ZAP handler, services.zmq_gate), so a stranger's frames
  are never buffered; and every ZMQ frame (steps, outputs, plans, KV events) carries an
  HMAC-SHA256 tag under a key derived from the token (`services.codec`), so a frame without
  a valid tag is dropped and logged by the receiver.

Why an HMAC per frame rather than ZMQ CURVE: CURVE needs key pairs handed to every member and
would encrypt every KV store chunk. The HMAC needs only the shared token, and a forged or
altered step or plan frame is refused whatever its sender. It does not encrypt: the internal
plane belongs on a private network (loopback by default, compose's internal network), as the
docs say.
"""

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.refusal_log import RefusalLog

log = logging.getLogger(__name__)

ENV = "SPLITSERVE_CLUSTER_TOKEN"
METADATA_KEY = "x-splitserve-token"
MIN_LENGTH = 16
TAG_BYTES = 32                                  # an HMAC-SHA256 digest
OPEN_SERVICES = ("/grpc.health.v1.Health/",)    # callable without the token


class TokenError(ValueError):
    """No usable cluster token in the environment."""


def generate() -> str:
    """A fresh token: 256 random bits, hex."""
    return secrets.token_hex(32)


def load(environ: dict[str, str] | None = None) -> str:
    """The token from the environment; refuses a missing or short one with what to do."""
    token = (os.environ if environ is None else environ).get(ENV, "")
    if len(token) < MIN_LENGTH:
        state = "is not set" if not token else f"is shorter than {MIN_LENGTH} characters"
        raise TokenError(f"{ENV} {state}: every member of a cluster must present the same "
                         f"secret (`splitserve up` makes one; with compose, export one, e.g. "
                         f"`openssl rand -hex 32`)")
    return token


def frame_key(token: str) -> bytes:
    """The ZMQ frames' HMAC key (derived, so the token itself never keys two things)."""
    return hashlib.sha256(b"splitserve frames\0" + token.encode()).digest()


def frame_tag(key: bytes, payload: bytes | memoryview) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """`metadata=` for a gRPC call on the control plane."""
    return ((METADATA_KEY, token),)


# The frame key of this process's cluster, installed once at a service's start (`install`);
# `services.codec.Codec` signs and checks frames with it. None (unit tests that build codecs
# directly): frames are plain.
_process_frame_key: bytes | None = None


def install(token: str) -> None:
    global _process_frame_key
    _process_frame_key = frame_key(token)


def join(logger: logging.Logger) -> str | None:
    """A service's start: load the token from the environment and install its frame key; on
    failure log why and return None (the service exits 2)."""
    try:
        token = load()
    except TokenError as exc:
        logger.error("%s", exc)
        return None
    install(token)
    return token


def installed_frame_key() -> bytes | None:
    return _process_frame_key


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call without the cluster token (health checks excepted)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.refusals = RefusalLog(log, "control-plane calls")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if isinstance(presented, str):
            presented = presented.encode()
        if hmac.compare_digest(presented, self._token):
            return await continuation(details)
        return _refusal(method, self.refusals)


def peer_host(peer: str) -> str:
    """"ipv4:10.0.0.7:41234" -> "10.0.0.7" (a peer's every connection is one peer)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        rest = rest.rsplit(":", 1)[0]
    return rest or peer


def _refusal(method: str, refusals: RefusalLog) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        refusals.refused(peer_host(context.peer()),
                         f"{method[:200]} without a valid cluster token")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{method} needs the cluster token ({ENV}) in the "
                            f"'{METADATA_KEY}' metadata")

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(request, context)
        yield  # pragma: no cover  (abort raises)

    if method.endswith(("/ServerReflectionInfo", "/Watch")):
        return grpc.stream_stream_rpc_method_handler(refuse_stream) \
            if method.endswith("/ServerReflectionInfo") \
            else grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)
