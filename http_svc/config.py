"""The HTTP front end's configuration, parsed once by `__main__` from its flags (with
SPLITSERVE_* fallbacks, services.service_flags.add_http_flags)."""

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = "127.0.0.1"                   # interface the HTTP API listens on
    port: int = 8000                          # the port OpenAI-compatible servers use
    scheduler_address: str = "127.0.0.1:50051"   # the scheduler's public gRPC HOST:PORT
    max_body_bytes: int = 32 << 20            # request bodies past this are refused (413)
    drain_timeout_s: float = 30.0             # after SIGTERM, open responses may finish
    max_prompts_per_request: int = 256        # completions prompts x n per request (400 past)
    max_connections: int = 1024               # open connections at once (503 past)
    request_read_timeout_s: float = 10.0      # to send a request's headers and body
    allowed_origins: tuple[str, ...] = ()     # CORS allow-list (empty: no CORS headers)
    log_level: str = "info"
    # vLLM's flags: the format tool calls are parsed from (http_svc.tool_parsers), whether
    # tool_choice "auto" (the default with tools) is served, and the reasoning format.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # Clients' API keys (services.api_keys; empty: open), the API's TLS files, and the CA to
    # trust the scheduler's TLS port with (None: plaintext to the scheduler).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    scheduler_ssl_ca: str | None = None
    # The scheduler's /metrics URL, served again at ours ("": the scheduler host's default
    # metrics port; "off": ours only). http_svc.metrics.
    scheduler_metrics: str = ""
