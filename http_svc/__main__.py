"""`python -m http_svc`: the OpenAI-compatible HTTP API, a process of its own in front of the
scheduler's public gRPC API (scale it apart from the scheduler: it holds no model and no
request state beyond the requests it is serving).

Flags (services.service_flags.add_http_flags) fall back to SPLITSERVE_HTTP_* environment
variables for containers. It starts without the scheduler and answers /health 503 until the
scheduler says a replica is ready. SIGTERM/SIGINT: stop accepting, let open responses finish
(up to --drain-timeout), exit 0; a port that cannot be bound exits 1.
"""

import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from http_svc.app import build_app
from http_svc.config import HttpConfig
from services.flags import FlagParser
from services.service_flags import add_http_flags

log = logging.getLogger("http_svc")


class Server(uvicorn.Server):
    """uvicorn's server, except that a drained SIGTERM or SIGINT ends in exit 0 (uvicorn
    raises the signal again once it has drained, so the process would die of it)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def parse_config(argv: list[str] | None = None) -> HttpConfig:
    p = add_http_flags(FlagParser(prog="python -m http_svc", description=__doc__))
    a = p.parse_args(argv)
    if not 1 <= a.port <= 65535:
        p.error("--port must be in [1, 65535]")
    if a.max_body_bytes < 1 or a.drain_timeout < 0:
        p.error("--max-body-bytes must be >= 1 and --drain-timeout >= 0")
    return HttpConfig(host=a.host, port=a.port, scheduler_address=a.scheduler,
                      max_body_bytes=a.max_body_bytes, drain_timeout_s=a.drain_timeout,
                      log_level=a.log_level)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("OpenAI-compatible HTTP API on http://%s:%d/v1, scheduler %s", config.host,
             config.port, config.scheduler_address)
    server = Server(uvicorn.Config(
        build_app(config), host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=int(config.drain_timeout_s), log_config=None))
    try:
        server.run()
    except SystemExit as exc:    # uvicorn exits 1 when it cannot bind
        return int(exc.code or 0)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
