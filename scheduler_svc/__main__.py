"""`python -m scheduler_svc`: the scheduler service. Its cluster process (this one) keeps the
workers' membership and starts the rest: one engine core process per replica
(scheduler_svc.engine) and `--frontends` front-end processes sharing the client port
(scheduler_svc.frontend). See scheduler_svc.cluster.server.

Flags (services.service_flags) fall back to SPLITSERVE_* environment variables (for
containers). SIGTERM/SIGINT drain: no new requests, live ones finish (up to --drain-timeout),
then exit 0.
"""

import asyncio
import dataclasses
import logging
import socket
import sys

from scheduler_svc.cluster.server import serve
from scheduler_svc.config import REQUEST_OVERHEAD_BYTES, ServerConfig
from scheduler_svc.engine.config import SchedulerConfig
from scheduler_svc.engine.wire import MAX_FRONTENDS
from services import cluster_token, tls
from services.flags import FlagParser
from services.model_config import default_model_path
from services.service_flags import add_scheduler_flags

log = logging.getLogger("scheduler_svc")

# The largest --max-prompt-bytes: gRPC's receive limit (this plus the request's other fields)
# is a C int.
MAX_PROMPT_BYTES = (1 << 31) - 1 - REQUEST_OVERHEAD_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    server: ServerConfig
    scheduler: SchedulerConfig
    drain_timeout: float
    log_level: str


def parse_args(argv: list[str] | None = None) -> Settings:
    p = add_scheduler_flags(FlagParser(prog="python -m scheduler_svc", description=__doc__))
    a = p.parse_args(argv)
    if a.max_num_seqs < 1 or a.max_num_batched_tokens < 1 or a.block_size < 1:
        p.error("--max-num-seqs, --max-num-batched-tokens and --block-size must be >= 1")
    if a.stream_interval < 1:
        p.error("--stream-interval must be >= 1")
    if a.max_concurrent_calls < 1:
        p.error(f"--max-concurrent-calls must be >= 1, got {a.max_concurrent_calls}")
    if not 0 < a.max_grammar_compile_s <= 3600:
        p.error(f"--max-grammar-compile-s must be in (0, 3600], got {a.max_grammar_compile_s}")
    if not 1 <= a.frontends <= MAX_FRONTENDS:
        p.error(f"--frontends must be in [1, {MAX_FRONTENDS}], got {a.frontends}")
    if a.max_prompt_bytes is not None and not 1 <= a.max_prompt_bytes <= MAX_PROMPT_BYTES:
        p.error(f"--max-prompt-bytes must be in [1, {MAX_PROMPT_BYTES}] (the gRPC receive "
                f"limit follows it and is a signed 32-bit count), got {a.max_prompt_bytes}")
    if a.num_kv_blocks is not None and a.num_kv_blocks < 2:
        p.error("--num-kv-blocks must be >= 2 (block 0 is the null block)")
    if a.tp < 1 or a.pp < 1:
        p.error("--tp and --pp must be >= 1")
    if a.async_scheduling and a.pp > 1:
        p.error("--async-scheduling needs --pp 1 (pipeline stages use the batch queue)")
    if a.async_scheduling is None:
        a.async_scheduling = a.pp == 1
    if (tls_error := tls.files_error(a.ssl_certfile, a.ssl_keyfile)) is not None:
        p.error(tls_error)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_path = str(a.model or default_model_path())
    advertise = a.advertise_host or a.host
    if advertise in ("0.0.0.0", "::"):
        advertise = socket.gethostbyname(socket.gethostname())  # a container's own address
    server = ServerConfig(
        model_path=model_path, model_name=a.served_model_name or "", host=a.host, port=a.port,
        control_host=a.control_host, control_port=a.control_port,
        advertise_host=advertise, kvcache_address=a.kvcache, dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization or "",
        tp_size=a.tp, pp_size=a.pp, num_kv_blocks=a.num_kv_blocks,
        step_timeout_s=a.step_timeout, max_batches_in_flight=a.max_batches_in_flight,
        heartbeat_timeout_s=a.heartbeat_timeout, replica_wait_s=a.replica_wait_timeout,
        route_tokens_per_request=a.route_tokens_per_request,
        metrics_port=None if a.metrics_port < 0 else a.metrics_port,
        async_scheduling=a.async_scheduling, max_prompt_bytes=a.max_prompt_bytes,
        stream_interval=a.stream_interval, chat_template=a.chat_template,
        tokenizer_path=a.tokenizer, generation_config=a.generation_config,
        num_frontends=a.frontends, api_keys=tuple(a.api_key), ssl_certfile=a.ssl_certfile,
        ssl_keyfile=a.ssl_keyfile, seed=a.seed,
        max_grammar_compile_s=a.max_grammar_compile_s,
        max_concurrent_calls=a.max_concurrent_calls)
    sched = SchedulerConfig(
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        chunked_prefill=not a.no_chunked_prefill,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        prefix_caching=not a.no_prefix_caching, block_size=a.block_size,
        layerwise_loads=not a.no_layerwise_kv_loads,
        max_model_len=a.max_model_len or 0, scheduling_policy=a.scheduling_policy)
    return Settings(server, sched, a.drain_timeout, a.log_level)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    if (token := cluster_token.join(log)) is None:
        return 2
    config = dataclasses.replace(settings.server, cluster_token=token)
    return asyncio.run(serve(config, settings.scheduler, settings.drain_timeout,
                             settings.log_level))


if __name__ == "__main__":
    sys.exit(main())
