"""The services as real processes with their workers on the GPU, for the GPU tests.

Like tests/e2e/harness.py's run_cluster (whose port picking and RunningCluster it reuses), but
on a given model directory and with `--device cuda`: on a GPU machine the default GGUF is
absent, and the CPU KV budget flag that run_cluster adds means nothing there.

SPLITSERVE_GPU_TEST_DEVICE=cpu runs the same tests with the workers and the oracle on the CPU:
a check of the tests' own plumbing on a machine without a GPU, never a substitute for the GPU
run."""

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc

from services.launcher import ClusterSpec, ServiceProcesses
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc, kvcache_pb2_grpc
from tests.e2e.harness import RunningCluster, free_ports, greedy_request, stream_tokens

# The test process holds the HF oracle on the same GPU; a worker sized at the default 0.9 of
# the card could leave it nothing when a fresh cluster starts.
GPU_MEMORY_UTILIZATION = "0.5"


def device_under_test() -> str:
    """"cuda" unless SPLITSERVE_GPU_TEST_DEVICE says otherwise (see the module docstring)."""
    return os.environ.get("SPLITSERVE_GPU_TEST_DEVICE", "cuda")


@contextmanager
def gpu_cluster(log_dir: Path, model_dir: Path, *, dtype: str = "float32",
                scheduler_args: Sequence[str] = (), worker_args: Sequence[str] = (),
                ready_timeout_s: float = 180.0, device: str | None = None,
                ) -> Iterator[RunningCluster]:
    """kvcache_svc + scheduler_svc + one worker on `device` (default the device under test;
    cuda: the first visible GPU) serving `model_dir` in `dtype`, checked once it is ready.
    Worker start-up on a GPU includes memory profiling and CUDA-graph capture; a start that
    takes over 3 minutes is stuck (scripts/gpu-check's budget), and fails."""
    device = device or device_under_test()
    port, control_port, plan_port, admin_port, events_port, store_port = free_ports(6)
    spec = ClusterSpec(model=str(model_dir), port=port, control_port=control_port,
                       kv_plan_port=plan_port, kv_store_port=store_port,
                       kv_admin_port=admin_port, kv_events_port=events_port, metrics_port=-1,
                       dtype=dtype, scheduler_args=tuple(scheduler_args),
                       worker_args=("--device", device, "--gpu-memory-utilization",
                                    GPU_MEMORY_UTILIZATION, *worker_args))
    procs = ServiceProcesses(spec, log_dir)
    procs.start()
    channel = grpc.insecure_channel(procs.address)
    admin = grpc.insecure_channel(f"127.0.0.1:{admin_port}")
    running = RunningCluster(procs, channel, generation_pb2_grpc.GenerationStub(channel),
                             kvcache_pb2_grpc.KvCacheAdminStub(admin), log_dir)
    try:
        try:
            procs.wait_ready(ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{running.logs()}") from exc
        assert_on_gpu(running, dtype, device)
        yield running
    finally:
        channel.close()
        admin.close()
        codes = procs.stop()
        bad = {name: code for name, code in codes.items() if code not in (0, -15)}
        assert not bad, f"services exited badly: {bad}\n{running.logs()}"


def replica_info(cluster: RunningCluster) -> generation_pb2.ReplicaInfo:
    return cluster.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10).replicas[0]


def assert_on_gpu(cluster: RunningCluster, dtype: str, device: str | None = None) -> None:
    """The replica really computes on `device` (CUDA by default) in `dtype`: a worker that
    fell back to the CPU would pass every comparison and test nothing."""
    replica = replica_info(cluster)
    devices = [w.device for w in replica.workers]
    want = (device or device_under_test()).partition(":")[0]
    assert devices and all(d.startswith(want) for d in devices), devices
    assert replica.dtype == dtype, replica.dtype


def run_concurrently(cluster: RunningCluster, prompts: Sequence[Sequence[int]],
                     max_tokens: int) -> list[list[int]]:
    """Every prompt streamed at once (one thread each); the tokens each got, in order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_tokens, cluster.stub, greedy_request(p, max_tokens))
                   for p in prompts]
        return [f.result()[0] for f in futures]
