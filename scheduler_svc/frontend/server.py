"""One front-end process: the client gRPC API on the shared client port, its core, and the
tasks that keep it in touch with the cluster and the engine cores.

Started by the cluster (scheduler_svc.cluster.frontends) as `python -m scheduler_svc.frontend`
with a `FrontendLaunch` on stdin. Everything runs on one asyncio loop: the gRPC server, a task
that reports to the cluster every STATE_INTERVAL_S and takes its state (readiness, routing,
moves off lost replicas), and a task that reads the engine cores' step messages. It exits on
SIGTERM after draining its live requests, or 2 when it cannot serve at all. With
`--api-key`, the client port takes calls with a configured key only (frontend.auth); with
`--ssl-certfile`/`--ssl-keyfile`, TLS only (services.tls). At most `--max-concurrent-calls`
calls run at once on the client port, health checks aside (services.grpc_server.CallLimit).
"""

import asyncio
import logging
import signal
import time

import zmq

from scheduler_svc.cluster.wire import FrontendLaunch
from scheduler_svc.frontend.auth import ApiKeyInterceptor
from scheduler_svc.frontend.core import Frontend, ModelFacts
from scheduler_svc.frontend.generation_config import load_generation_defaults
from scheduler_svc.frontend.grammar import Grammars
from scheduler_svc.frontend.links import ClusterLink, EngineLinks
from scheduler_svc.frontend.metrics import RequestMetrics
from scheduler_svc.frontend.router import Router
from scheduler_svc.frontend.servicer import GenerationServicer
from scheduler_svc.frontend.tokenizer import load_tokenizer, read_chat_template
from scheduler_svc.frontend.validation import (
    Limits,
    default_max_prompt_bytes,
    max_request_bytes,
    seed_stream,
)
from services import heap, tls
from services.api_keys import ApiKeys
from services.grpc_server import CallLimit, Health, bind, make_server
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import generation_pb2_grpc

log = logging.getLogger("scheduler_svc.frontend")

GENERATION_SERVICE = "splitserve.v1.Generation"
FATAL_EXIT = 2


async def serve(launch: FrontendLaunch) -> int:
    config, sched = launch.server, launch.scheduler
    try:
        model = load_model_config(config.model_path)
        template = None if config.chat_template is None else read_chat_template(
            config.chat_template)
        tokenizer = load_tokenizer(config.model_path, template, config.tokenizer_path)
        defaults = load_generation_defaults(config.generation_config, config.model_path)
    except ValueError as exc:            # ModelFormatError, or a tokenizer we cannot build
        log.error("cannot serve %s: %s", config.model_path, exc)
        return FATAL_EXIT
    max_model_len = sched.max_model_len
    max_prompt_bytes = config.max_prompt_bytes or default_max_prompt_bytes(
        max_model_len, tokenizer.max_token_bytes)
    keys = ApiKeys(config.api_keys)
    server = make_server(max_request_bytes(max_prompt_bytes, max_model_len), reuse_port=True,
                         first=[ApiKeyInterceptor(keys)] if keys else [],
                         call_limit=CallLimit(config.max_concurrent_calls,
                                              "--max-concurrent-calls"))
    health = Health(server, [GENERATION_SERVICE])
    ctx = zmq.Context()
    engines = EngineLinks(ctx, launch.index, time.time_ns(), launch.internal_host)
    cluster = ClusterLink(ctx, launch.query_address, launch.index)
    router = Router(ctx, config.kvcache_address, sched.block_size, sched.prefix_caching,
                    config.route_tokens_per_request)
    limits = Limits(launch.served_name, model.vocab_size, max_model_len,
                    max_prompt_bytes=max_prompt_bytes,
                    seeds=seed_stream(config.seed, launch.index))
    frontend = Frontend(
        launch.index, tokenizer, limits, ModelFacts(tuple(model.eos_token_ids),
                                                    model.vocab_size),
        router, engines, max_live_requests=config.max_queue_len,
        replica_wait_s=config.replica_wait_s,
        metrics=RequestMetrics(launch.served_name, max_model_len=max_model_len),
        grammars=Grammars(tokenizer, model.vocab_size, model.eos_token_ids,
                          config.max_grammar_compile_s),
        stream_interval=config.stream_interval, generation_defaults=defaults)
    if defaults.as_dict() and launch.index == 0:
        log.info("default sampling settings from the model's generation config: %s (unset "
                 "fields only; --generation-config vllm turns them off)", defaults.as_dict())
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(frontend, model, sched, cluster, launch.served_name,
                           config.num_frontends, keys), server)
    try:
        credentials = None if config.ssl_certfile is None or config.ssl_keyfile is None \
            else tls.server_credentials(config.ssl_certfile, config.ssl_keyfile)
        bind(server, config.host, config.port, credentials)
    except OSError as exc:
        log.error("%s", exc)
        return FATAL_EXIT
    heap.settle()
    await server.start()
    await health.set_live()
    await health.set_ready(False)

    ready = False

    def take_state(state: object) -> None:
        nonlocal ready
        frontend.take_state(state)  # type: ignore[arg-type]
        if frontend.ready != ready:
            ready = frontend.ready
            asyncio.ensure_future(health.set_ready(ready))

    async def read_outputs() -> None:
        while True:
            message = await engines.recv()
            try:
                frontend.take_outputs(message)
            except Exception:     # a bug: keep serving the others
                log.exception("handling a step message failed")

    tasks = [asyncio.ensure_future(cluster.run(frontend.report, take_state)),
             asyncio.ensure_future(read_outputs())]
    log.info("front end %d serving %r on %s:%d (prompts up to %d bytes; up to %d calls at "
             "once; %s; %s)", launch.index, launch.served_name, config.host, config.port,
             max_prompt_bytes, config.max_concurrent_calls,
             "TLS" if credentials is not None else "plaintext",
             f"{len(keys)} API key(s)" if keys else "no API key: open to all")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    # SIGTERM drains: no new requests, live ones finish (the cluster drained this front end
    # first, or the signal came to the whole process group at once).
    frontend.draining = True
    await health.set_ready(False)
    deadline = loop.time() + launch.drain_timeout_s
    while frontend.num_live and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for request in list(frontend.live.parked()):
        frontend.cancel(request)
    await health.shutdown()
    await server.stop(grace=1.0)
    for task in tasks:
        task.cancel()
    router.close()
    engines.close()
    cluster.close()
    frontend.close()
    ctx.destroy(linger=0)
    return 0
