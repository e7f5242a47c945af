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
from http_svc.reasoning import REASONING_PARSERS
from http_svc.slow_clients import protocol_factory
from http_svc.tool_parsers import TOOL_PARSERS
from services import tls
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
    for flag, value, names in (("--tool-call-parser", a.tool_call_parser, TOOL_PARSERS),
                               ("--reasoning-parser", a.reasoning_parser, REASONING_PARSERS)):
        if value is not None and value not in names:
            p.error(f"{flag}: {value!r} is not one of {', '.join(sorted(names))}")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser")
    if not 1 <= a.port <= 65535:
        p.error("--port must be in [1, 65535]")
    if a.max_body_bytes < 1 or a.drain_timeout < 0:
        p.error("--max-body-bytes must be >= 1 and --drain-timeout >= 0")
    if a.max_prompts_per_request < 1 or a.max_connections < 1 or a.request_read_timeout <= 0:
        p.error("--max-prompts-per-request and --max-connections must be >= 1, "
                "--request-read-timeout > 0")
    origins = tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip())
    if (tls_error := tls.files_error(a.ssl_certfile, a.ssl_keyfile)
            or tls.ca_error("--scheduler-ssl-ca", a.scheduler_ssl_ca)) is not None:
        p.error(tls_error)
    if a.scheduler_metrics not in ("", "off") and not a.scheduler_metrics.startswith(
            ("http://", "https://")):
        p.error(f"--scheduler-metrics: {a.scheduler_metrics!r} is not an http(s) URL")
    return HttpConfig(host=a.host, port=a.port, scheduler_address=a.scheduler,
                      max_body_bytes=a.max_body_bytes, drain_timeout_s=a.drain_timeout,
                      max_prompts_per_request=a.max_prompts_per_request,
                      max_connections=a.max_connections,
                      request_read_timeout_s=a.request_read_timeout, allowed_origins=origins,
                      log_level=a.log_level, tool_call_parser=a.tool_call_parser,
                      enable_auto_tool_choice=a.enable_auto_tool_choice,
                      reasoning_parser=a.reasoning_parser,
                      api_keys=tuple(a.api_key), ssl_certfile=a.ssl_certfile,
                      ssl_keyfile=a.ssl_keyfile, scheduler_ssl_ca=a.scheduler_ssl_ca,
                      scheduler_metrics=a.scheduler_metrics)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1 (%s), scheduler %s",
             "https" if config.ssl_certfile else "http", config.host, config.port,
             f"{len(set(config.api_keys))} API key(s)" if config.api_keys else "no API key",
             config.scheduler_address)
    server = Server(uvicorn.Config(
        build_app(config), host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=int(config.drain_timeout_s), log_config=None,
        ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile,
        # h11 with a read deadline and a connection cap (503 past it) instead of uvicorn's
        # limit_concurrency, whose 503 is plain text and logged once per request.
        http=protocol_factory(config.request_read_timeout_s,  # type: ignore[arg-type]
                              config.max_connections)))
    try:
        server.run()
    except SystemExit as exc:    # uvicorn exits 1 when it cannot bind
        return int(exc.code or 0)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
