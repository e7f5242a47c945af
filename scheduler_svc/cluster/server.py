"""The scheduler's cluster process: membership and the control listener, the hub its engine
cores and front ends talk to, /metrics, and the front-end processes it starts and watches.

`python -m scheduler_svc` (scheduler_svc.__main__) parses the flags and calls `serve`.
SIGTERM/SIGINT drain: the front ends take no new requests, live ones finish (up to
--drain-timeout), then every child stops and the process exits 0.
"""

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
import time

import zmq

from scheduler_svc.cluster.frontends import FrontendProcesses
from scheduler_svc.cluster.hub import Hub
from scheduler_svc.cluster.membership import Membership
from scheduler_svc.cluster.metrics import ClusterMetrics
from scheduler_svc.cluster.servicer import WorkerControlServicer
from scheduler_svc.cluster.stats import cluster_stats_reply
from scheduler_svc.cluster.wire import FrontendLaunch
from scheduler_svc.config import ServerConfig
from scheduler_svc.engine.config import SchedulerConfig
from services.grpc_server import Health, bind, make_server
from services.kv_groups import KvGroupLayout
from services.model_config import load_model_config
from services.rpc.splitserve.v1 import control_pb2_grpc

log = logging.getLogger("scheduler_svc")

CONTROL_SERVICE = "splitserve.v1.WorkerControl"
CHECK_INTERVAL_S = 0.25


def client_port(host: str, port: int) -> int:
    """The client port the front ends will share: `port`, or a free one for 0. Raises OSError
    when another process listens there (the front ends bind it with SO_REUSEPORT, which would
    not say so). SO_REUSEADDR, as gRPC's own listener: connections of an earlier scheduler
    still in TIME_WAIT do not hold the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return int(s.getsockname()[1])


def internal_host(control_host: str) -> str:
    """The interface of the cluster's private sockets (the hub's, the engine cores' command
    sockets, the front ends' output sockets): the control listener's, as an address; loopback
    where that listens on every interface (no wildcard listener)."""
    if control_host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return socket.gethostbyname(control_host)


def engine_scheduler_config(sched: SchedulerConfig, model_max_len: int,
                            windows: tuple[int, ...]) -> SchedulerConfig:
    """The batching policy with the model's limits applied."""
    max_model_len = min(sched.max_model_len or model_max_len, model_max_len)
    return dataclasses.replace(sched, max_model_len=max_model_len, kv_group_windows=windows)


async def serve(config: ServerConfig, sched: SchedulerConfig, drain_timeout: float,
                log_level: str) -> int:
    try:
        model = load_model_config(config.model_path)
    except ValueError as exc:            # ModelFormatError
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
    sched = engine_scheduler_config(sched, model.max_model_len,
                                    KvGroupLayout.from_windows(model.layer_windows).windows)
    try:
        port = client_port(config.host, config.port)
    except OSError as exc:
        log.error("cannot bind the client port %s:%d: %s", config.host, config.port, exc)
        return 1
    config = dataclasses.replace(config, port=port)
    ctx = zmq.Context()
    private = internal_host(config.control_host)
    hub = Hub(ctx, config.kvcache_address, log_level, private)
    membership = Membership(config, sched, model, ctx, engines=hub)
    hub.membership = membership
    # Workers register on a listener of their own that only the cluster's members may use
    # (services.cluster_token): the public port offers no control service.
    control = make_server(cluster_token=config.cluster_token)
    control_health = Health(control, [CONTROL_SERVICE])
    control_pb2_grpc.add_WorkerControlServicer_to_server(WorkerControlServicer(membership),
                                                         control)
    try:
        control_port = bind(control, config.control_host, config.control_port)
    except OSError as exc:
        log.error("%s", exc)
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="splitserve-metrics-")
    if config.metrics_port is not None:
        metrics = ClusterMetrics(served_name, lambda: cluster_stats_reply(
            membership, list(hub.frontends.values())), metrics_dir)
        try:
            metrics_port = metrics.serve(config.host, config.metrics_port)
        except OSError as exc:
            log.error("cannot bind the metrics port %s:%d: %s", config.host,
                      config.metrics_port, exc)
            return 1
        log.info("Prometheus metrics on http://%s:%d/metrics", config.host, metrics_port)

    def launch_for(index: int) -> FrontendLaunch:
        return FrontendLaunch(index=index, parent_pid=os.getpid(),
                              server=dataclasses.replace(config, cluster_token=""),
                              scheduler=sched, served_name=served_name,
                              query_address=hub.query_address, internal_host=private,
                              drain_timeout_s=drain_timeout, log_level=log_level)

    frontends = FrontendProcesses(config.num_frontends, launch_for,
                                  {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir})
    await control.start()
    await control_health.set_live()
    await control_health.set_ready(True)
    membership.start()
    hub.start()
    frontends.start()
    log.info("scheduler_svc serving %s as %r on %s:%d with %d front end(s) (dtype %s, tp %d, "
             "pp %d); workers register on %s:%d", model.name, served_name, config.host, port,
             config.num_frontends, config.dtype, config.tp_size, config.pp_size,
             config.control_host, control_port)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), CHECK_INTERVAL_S)
            except TimeoutError:
                pass
            frontends.check()
            if frontends.fatal is not None:
                log.error("%s", frontends.fatal)
                code = 2
                break
        if code == 0:
            await drain(membership, hub, frontends, drain_timeout)
    finally:
        frontends.stop()
        membership.shutdown()
        hub.shutdown()
        await control_health.shutdown()
        await control.stop(grace=0.5)
        ctx.destroy(linger=0)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("scheduler_svc stopped")
    return code


async def drain(membership: Membership, hub: Hub, frontends: FrontendProcesses,
                timeout_s: float) -> None:
    """No new requests; waits until every running front end reports none live (a report sent
    after draining began), or `timeout_s`."""
    started = time.monotonic()
    membership.draining = True
    while time.monotonic() - started < timeout_s:
        running = frontends.running()
        if all(hub.seen_at(i) > started and not hub.frontends[i].num_live for i in running):
            break
        await asyncio.sleep(0.05)
    log.info("drained in %.1fs", time.monotonic() - started)
