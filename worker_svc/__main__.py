"""`python -m worker_svc --scheduler HOST:PORT`: one model shard (a pipeline stage and a
tensor-parallel slice) serving steps for its replica.

Life: bind the StepInput socket, register with the scheduler (placement comes back), load the
shard, size the KV cache from the memory budget, report the block count, then serve steps
until told to stop. If the scheduler stops knowing the worker (it restarted, or took the
replica down), the worker registers again as a new incarnation and keeps its loaded shard
when the new placement is the same. Flags fall back to SPLITSERVE_* environment variables.
"""

import os

# OpenMP threads that spin-wait at barriers collapse when another process shares the cores (the
# scheduler, or clients on a small box): 64 streaming clients made each step 10x slower. A short
# spin, then sleep, keeps quiet-machine speed. libgomp reads this when torch loads it, so it is
# set before anything imports torch.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from services import cluster_token
from services.model_config import ModelFormatError, default_model_path
from worker_svc.device import DeviceError, resolve_device
from worker_svc.kernels.cpu import describe, select_level
from worker_svc.memory import keep_freed_memory
from worker_svc.server import WorkerConfig, WorkerServer

log = logging.getLogger("worker_svc")


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPLITSERVE_{name}", default)


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="python -m worker_svc", description=__doc__)
    p.add_argument("--scheduler", default=env("SCHEDULER", "127.0.0.1:50052"),
                   help="the scheduler's control listener HOST:PORT (its --control-port)")
    p.add_argument("--model", default=env("MODEL"), help="GGUF file or HF directory")
    p.add_argument("--host", default=env("WORKER_HOST", "127.0.0.1"),
                   help="interface to bind the step socket on")
    p.add_argument("--advertise-host", default=env("WORKER_ADVERTISE_HOST"),
                   help="address the scheduler uses to reach this worker (default: --host)")
    p.add_argument("--port", type=int, default=int(env("WORKER_PORT", "0") or 0),
                   help="step socket port (0: any free port)")
    p.add_argument("--worker-id", default=env("WORKER_ID"))
    p.add_argument("--device", default=env("DEVICE", "auto"),
                   help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--kv-cache-memory-gib", type=float,
                   default=float(env("KV_CACHE_MEMORY_GIB", "2") or 2),
                   help="CPU: the most memory the KV cache may take (less if the host has "
                        "less available)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=float(env("GPU_MEMORY_UTILIZATION", "0.9") or 0.9),
                   help="GPU: share of the GPU's memory for weights, activations and the KV "
                        "cache")
    p.add_argument("--enforce-eager", action="store_true",
                   default=env("ENFORCE_EAGER", "0") in ("1", "true", "yes", "on"),
                   help="GPU: no CUDA graphs (every step launched op by op)")
    p.add_argument("--threads", type=int, default=int(env("THREADS", "0") or 0),
                   help="torch and kernel threads (0: the CPUs this process may use: its "
                        "affinity, capped by a container's CPU quota)")
    p.add_argument("--no-quant-kernels", "--no-int4-kernels", action="store_true",
                   default="1" in (env("NO_QUANT_KERNELS"), env("NO_INT4_KERNELS")),
                   help="never multiply small steps on the GGUF's quantized blocks (Q4_0, "
                        "Q4_1, Q8_0): dense weights only")
    p.add_argument("--cpu-level", default=env("CPU_LEVEL", "auto"),
                   help="instruction set of the C kernels and matmul paths: auto (the best "
                        "this CPU has), avx512_bf16, avx512, avx2 or none (torch only); a "
                        "level above the CPU's is refused")
    p.add_argument("--register-timeout", type=float, default=60.0,
                   help="seconds to reach the scheduler at start (and for the replica's "
                        "ranks to meet); after the first registration it retries forever")
    p.add_argument("--health-file", default=env("HEALTH_FILE"),
                   help="touched on every acknowledged heartbeat (container healthcheck)")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "info"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    level = a.cpu_level
    if env("CPU_KERNELS", "1") in ("0", "false", "no", "off"):   # the older switch
        level = "none"
    try:
        cpu_level = select_level(level)
    except ValueError as exc:
        p.error(str(exc))
    log.info("%s", describe(cpu_level))
    try:
        device = resolve_device(a.device)
    except DeviceError as exc:
        p.error(str(exc))
    if not 0.0 < a.gpu_memory_utilization <= 1.0:
        p.error(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    overlap = os.environ.get("SPLITSERVE_OVERLAP_STEPS")  # tests: force on (1) or off (0)
    worker_id = a.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    advertise = a.advertise_host or a.host
    if advertise in ("0.0.0.0", "::"):
        # Bound to every interface (a container): advertise this host's own address.
        advertise = socket.gethostbyname(socket.gethostname())
    return WorkerConfig(
        scheduler_address=a.scheduler, model_path=str(a.model or default_model_path()),
        host=a.host, advertise_host=advertise, port=a.port,
        worker_id=worker_id, epoch=time.time_ns(), device=device,
        kv_cache_bytes=int(a.kv_cache_memory_gib * (1 << 30)),
        gpu_memory_utilization=a.gpu_memory_utilization, num_threads=a.threads,
        quant_kernels=not a.no_quant_kernels, cpu_level=cpu_level,
        register_timeout_s=a.register_timeout, health_file=a.health_file,
        enforce_eager=a.enforce_eager,
        overlap_steps=None if overlap is None else overlap == "1",
        # End-to-end tests only (tests/e2e/test_step_path.py): no flag, so no user meets it.
        fail_request_prefix=os.environ.get("SPLITSERVE_TEST_FAIL_REQUEST_PREFIX") or None)


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
