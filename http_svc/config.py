"""The HTTP front end's configuration, parsed once by `__main__` from its flags (with
SPLITSERVE_* fallbacks, services.service_flags.add_http_flags)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "127.0.0.1"                   # interface the HTTP API listens on
    port: int = 8000                          # the port OpenAI-compatible servers use
    scheduler_address: str = "127.0.0.1:50051"   # the scheduler's public gRPC HOST:PORT
    max_body_bytes: int = 32 << 20            # request bodies past this are refused (413)
    drain_timeout_s: float = 30.0             # after SIGTERM, open responses may finish
    log_level: str = "info"
