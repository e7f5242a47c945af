"""`WorkerConfig`: a worker process's settings, parsed once by worker_svc.__main__ (flags with
SPLITSERVE_* environment fallbacks) and passed down, frozen, to worker_svc.server and
worker_svc.placement."""

from dataclasses import dataclass

import torch

from worker_svc.kernels import CpuLevel
from worker_svc.null_runner import NullModelOptions


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    scheduler_address: str          # scheduler gRPC HOST:PORT
    model_path: str
    host: str                       # interface for the step socket
    advertise_host: str             # how the scheduler reaches it
    port: int                       # 0 = any free port
    worker_id: str
    epoch: int                      # incarnation, ns since the Unix epoch at start
    device: torch.device            # resolved from --device (worker_svc.device)
    kv_cache_bytes: int             # CPU: the cap on the KV budget
    gpu_memory_utilization: float   # GPU: share of its memory the worker may use
    num_threads: int                # 0 = the CPUs this process may use (services.cpus)
    quant_kernels: bool             # small steps on the GGUF's quantized blocks
    cpu_level: CpuLevel             # the C kernels' instruction set (kernels/cpu.py)
    register_timeout_s: float
    health_file: str | None = None  # touched on every acknowledged heartbeat
    enforce_eager: bool = False     # no CUDA graphs
    cluster_token: str = ""         # presented on every control call (services.cluster_token)
    # Launch the next step before reading the last one's tokens (None: on CUDA and with the
    # null model only).
    overlap_steps: bool | None = None
    fail_request_prefix: str | None = None  # tests only: steps with such a request raise
    kv_store: str = ""              # kvcache_svc's KV store, tcp://HOST:PORT ("": no saving)
    # --null-model: serve with worker_svc.null_runner (no weights, nothing computed; None:
    # the model). Launches ahead as on CUDA unless overlap_steps says otherwise.
    null_model: NullModelOptions | None = None
