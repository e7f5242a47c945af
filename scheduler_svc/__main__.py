"""`python -m scheduler_svc`: the client gRPC API, worker registration and the replicas' engines.

Flags (services.service_flags) fall back to SPLITSERVE_* environment variables (for
containers). SIGTERM/SIGINT drain: no new requests, live ones finish (up to --drain-timeout),
then exit 0.
"""

import asyncio
import dataclasses
import logging
import signal
import socket
import sys

import zmq

from scheduler_svc.config import SchedulerConfig, ServerConfig
from scheduler_svc.frontend import Frontend
from scheduler_svc.grammar import Grammars
from scheduler_svc.live_requests import LiveRequests
from scheduler_svc.membership import Membership
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.router import Router
from scheduler_svc.servicer import GenerationServicer, WorkerControlServicer
from scheduler_svc.stats import cluster_stats
from scheduler_svc.tokenizer import load_tokenizer, read_chat_template
from scheduler_svc.validation import (
    REQUEST_OVERHEAD_BYTES,
    Limits,
    default_max_prompt_bytes,
    max_request_bytes,
)
from services import cluster_token
from services.flags import FlagParser
from services.grpc_server import Health, bind, make_server
from services.kv_groups import KvGroupLayout
from services.model_config import default_model_path, load_model_config
from services.rpc.splitserve.v1 import control_pb2_grpc, generation_pb2_grpc
from services.service_flags import add_scheduler_flags

log = logging.getLogger("scheduler_svc")

GENERATION_SERVICE = "splitserve.v1.Generation"
CONTROL_SERVICE = "splitserve.v1.WorkerControl"
# The largest --max-prompt-bytes: gRPC's receive limit (this plus the request's other fields)
# is a C int.
MAX_PROMPT_BYTES = (1 << 31) - 1 - REQUEST_OVERHEAD_BYTES


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, SchedulerConfig, float]:
    p = add_scheduler_flags(FlagParser(prog="python -m scheduler_svc", description=__doc__))
    a = p.parse_args(argv)
    if a.max_num_seqs < 1 or a.max_num_batched_tokens < 1 or a.block_size < 1:
        p.error("--max-num-seqs, --max-num-batched-tokens and --block-size must be >= 1")
    if a.stream_interval < 1:
        p.error("--stream-interval must be >= 1")
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
        tp_size=a.tp, pp_size=a.pp, num_kv_blocks=a.num_kv_blocks,
        step_timeout_s=a.step_timeout, max_batches_in_flight=a.max_batches_in_flight,
        heartbeat_timeout_s=a.heartbeat_timeout, replica_wait_s=a.replica_wait_timeout,
        route_tokens_per_request=a.route_tokens_per_request,
        metrics_port=None if a.metrics_port < 0 else a.metrics_port,
        async_scheduling=a.async_scheduling, max_prompt_bytes=a.max_prompt_bytes,
        stream_interval=a.stream_interval, chat_template=a.chat_template)
    sched = SchedulerConfig(
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        chunked_prefill=not a.no_chunked_prefill,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        prefix_caching=not a.no_prefix_caching, block_size=a.block_size,
        layerwise_loads=not a.no_layerwise_kv_loads,
        max_model_len=a.max_model_len or 0)
    return server, sched, a.drain_timeout


async def serve(config: ServerConfig, sched: SchedulerConfig, drain_timeout: float) -> int:
    try:
        model = load_model_config(config.model_path)
        template = None if config.chat_template is None else read_chat_template(
            config.chat_template)
        tokenizer = load_tokenizer(config.model_path, template)
    except ValueError as exc:            # ModelFormatError, or a tokenizer we cannot build
        log.error("cannot serve %s: %s", config.model_path, exc)
        return 2
    if config.tp_size > model.num_heads:
        log.error("--tp %d: the model has only %d attention heads to split", config.tp_size,
                  model.num_heads)
        return 2
    if config.pp_size > model.num_layers:
        log.error("--pp %d: the model has only %d layers to split", config.pp_size,
                  model.num_layers)
        return 2
    # The public name only: `model.name` stays the loaded model's own, which workers report
    # when they register (they know nothing of --served-model-name).
    served_name = config.model_name or model.name
    max_model_len = min(sched.max_model_len or model.max_model_len, model.max_model_len)
    sched = type(sched)(**{**{f: getattr(sched, f) for f in sched.__slots__},
                           "max_model_len": max_model_len,
                           "kv_group_windows": KvGroupLayout.from_windows(
                               model.layer_windows).windows})
    max_prompt_bytes = config.max_prompt_bytes or default_max_prompt_bytes(
        max_model_len, tokenizer.max_token_bytes)
    ctx = zmq.Context()
    server = make_server(max_request_bytes(max_prompt_bytes, max_model_len))
    health = Health(server, [GENERATION_SERVICE])
    # Workers register on a listener of their own that only the cluster's members may use
    # (services.cluster_token): the public port offers no control service.
    control = make_server(cluster_token=config.cluster_token)
    control_health = Health(control, [CONTROL_SERVICE])
    loop = asyncio.get_running_loop()

    def readiness_changed() -> None:
        # Ready: a replica serves, kvcache_svc answers, and we are not draining.
        ready = membership.is_ready() and not frontend.draining
        asyncio.run_coroutine_threadsafe(health.set_ready(ready), loop)

    live = LiveRequests()
    membership = Membership(config, sched, model, ctx, live.deliver, on_change=readiness_changed)
    router = Router(membership, live, ctx)
    membership.listen(router)
    metrics = SchedulerMetrics(served_name)
    metrics.attach(lambda: cluster_stats(membership, router))
    limits = Limits(served_name, model.vocab_size, max_model_len,
                    max_prompt_bytes=max_prompt_bytes)
    frontend = Frontend(router, tokenizer, limits, max_live_requests=config.max_queue_len,
                        replica_wait_s=config.replica_wait_s, metrics=metrics,
                        grammars=Grammars(tokenizer, model.vocab_size, model.eos_token_ids),
                        stream_interval=config.stream_interval)
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(frontend, model, served_name), server)
    control_pb2_grpc.add_WorkerControlServicer_to_server(WorkerControlServicer(membership),
                                                         control)
    try:
        port = bind(server, config.host, config.port)
        control_port = bind(control, config.control_host, config.control_port)
    except OSError as exc:
        log.error("%s", exc)
        return 1
    if config.metrics_port is not None:
        try:
            metrics_port = metrics.serve(config.host, config.metrics_port)
        except OSError as exc:
            log.error("cannot bind the metrics port %s:%d: %s", config.host,
                      config.metrics_port, exc)
            return 1
        log.info("Prometheus metrics on http://%s:%d/metrics", config.host, metrics_port)
    await server.start()
    await control.start()
    await health.set_live()
    await health.set_ready(False)
    await control_health.set_live()
    await control_health.set_ready(True)
    membership.start()
    router.start()
    log.info("scheduler_svc serving %s as %r on %s:%d (dtype %s, tp %d, pp %d, prompts up to "
             "%d bytes); workers register on %s:%d", model.name, served_name, config.host,
             port, config.dtype, config.tp_size, config.pp_size, max_prompt_bytes,
             config.control_host, control_port)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining: %d live requests", frontend.num_live)
    frontend.draining = True                 # no new admissions; live requests finish
    await health.set_ready(False)
    deadline = loop.time() + drain_timeout
    while frontend.num_live and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await health.shutdown()
    await server.stop(grace=1.0)
    await control.stop(grace=0.5)
    router.shutdown()
    membership.shutdown()
    frontend.close()
    ctx.destroy(linger=0)
    log.info("scheduler_svc stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    config, sched, drain_timeout = parse_args(argv)
    if (token := cluster_token.join(log)) is None:
        return 2
    config = dataclasses.replace(config, cluster_token=token)
    return asyncio.run(serve(config, sched, drain_timeout))


if __name__ == "__main__":
    sys.exit(main())
