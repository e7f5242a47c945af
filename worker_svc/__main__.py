"""`python -m worker_svc --scheduler HOST:PORT`: one model shard (a pipeline stage and a
tensor-parallel slice) serving steps for its replica.

Life: bind the StepInput socket, register with the scheduler (placement comes back), load the
shard, size the KV cache from the memory budget, report the block count, then serve steps
until told to stop. If the scheduler stops knowing the worker (it restarted, or took the
replica down), the worker registers again as a new incarnation and keeps its loaded shard
when the new placement is the same. Flags (services.service_flags) fall back to SPLITSERVE_*
environment variables.
"""

# ruff: noqa: E402  (the worker's environment is set before anything imports torch)
from worker_svc.process_env import apply_worker_env

apply_worker_env()      # libgomp reads it when torch loads it

import argparse
import dataclasses
import logging
import os
import socket
import sys
import time

from services import cluster_token
from services.flags import FlagParser, parse_bool
from services.model_config import ModelFormatError, default_model_path
from services.service_flags import add_worker_flags
from worker_svc.config import WorkerConfig
from worker_svc.device import DeviceError, resolve_device
from worker_svc.kernel_choice import resolve_choice
from worker_svc.kernels.build import usable_level
from worker_svc.kernels.cpu import cap_onednn, describe, select_level
from worker_svc.memory import keep_freed_memory
from worker_svc.null_runner import NullModelOptions
from worker_svc.server import WorkerServer

log = logging.getLogger("worker_svc")


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    p = add_worker_flags(FlagParser(prog="python -m worker_svc", description=__doc__))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    level = a.cpu_level
    if not p.env("CPU_KERNELS", parse_bool, True):   # the older switch
        level = "none"
    try:
        cpu_level = select_level(level)
        device = resolve_device(a.device)
        kernels = resolve_choice(device)
    except (ValueError, DeviceError) as exc:
        p.error(str(exc))
    if kernels == "c":
        # The level this worker reports is the one its kernels really build at.
        cpu_level = usable_level(cpu_level)
    cap_onednn(cpu_level)
    log.info("%s", describe(cpu_level))
    overlap = p.env("OVERLAP_STEPS", parse_bool, None)    # tests: force on (1) or off (0)
    null_model = null_model_options(p, a)
    worker_id = a.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    # `auto`: this host's own address (a scaled container's, which no static name tells).
    host = socket.gethostbyname(socket.gethostname()) if a.host == "auto" else a.host
    advertise = a.advertise_host or host
    if advertise in ("0.0.0.0", "::"):
        # Bound to every interface (a container): advertise this host's own address.
        advertise = socket.gethostbyname(socket.gethostname())
    return WorkerConfig(
        scheduler_address=a.scheduler, model_path=str(a.model or default_model_path()),
        host=host, advertise_host=advertise, port=a.port,
        worker_id=worker_id, epoch=time.time_ns(), device=device,
        kv_cache_bytes=int(a.kv_cache_memory_gib * (1 << 30)),
        gpu_memory_utilization=a.gpu_memory_utilization, num_threads=a.threads,
        quant_kernels=not a.no_quant_kernels, cpu_level=cpu_level,
        register_timeout_s=a.register_timeout, health_file=a.health_file,
        enforce_eager=a.enforce_eager, overlap_steps=overlap, kv_store=a.kv_store,
        null_model=null_model,
        # End-to-end tests only (tests/e2e/test_step_path.py): no flag, so no user meets it.
        fail_request_prefix=p.env("TEST_FAIL_REQUEST_PREFIX", str, None))


def null_model_options(p: FlagParser, a: argparse.Namespace) -> NullModelOptions | None:
    """--null-model's settings (None: serve the model); its other flags need it."""
    if a.null_eos_step < 0:
        p.error(f"--null-eos-step {a.null_eos_step}: expected 0 (off) or an output token, "
                f"1-based")
    if not a.null_model:
        if (a.null_step_ms, a.null_eos_step, a.null_eos_share, a.null_no_metadata) != (
                0.0, 0, 1.0, False):
            p.error("--null-step-ms, --null-eos-step, --null-eos-share and --null-no-metadata "
                    "need --null-model")
        return None
    return NullModelOptions(step_ms=a.null_step_ms, eos_step=a.null_eos_step,
                            eos_share=a.null_eos_share, metadata=not a.null_no_metadata)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    if (token := cluster_token.join(log)) is None:
        return 2
    config = dataclasses.replace(config, cluster_token=token)
    keep_freed_memory()
    try:
        return WorkerServer(config).run()
    except (ModelFormatError, OSError) as exc:
        log.error("worker cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
