"""`splitserve`: start a local cluster (`up`) or talk to one (`generate`).

    splitserve up [--model PATH] [--port 50051] [--dtype auto|float32|bfloat16] ...
    splitserve up --device cuda [--gpu-memory-utilization 0.9] [--enforce-eager] ...
    splitserve generate "Tell me a story" [--max-tokens 64] [--json]

`up` gives every service the same cluster token (SPLITSERVE_CLUSTER_TOKEN): the one in the
environment if set, else a fresh one for this cluster that is never shown (set your own to
add workers by hand).
"""

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import grpc

from services import cluster_token
from services.launcher import ClusterSpec, DevicePlanError, ServiceProcesses, plan_devices
from services.rpc.splitserve.v1 import generation_pb2, generation_pb2_grpc


def visible_gpus() -> int:
    """CUDA GPUs torch sees here. torch is imported only when a GPU may be wanted: it takes
    seconds, and `generate` (or `up --device cpu`) never needs it."""
    import torch

    return torch.cuda.device_count()


def cluster_spec(a: argparse.Namespace, num_gpus: int) -> ClusterSpec:
    """`up`'s flags as what to start; raises DevicePlanError when the workers cannot each get
    a GPU of their own among the `num_gpus` this machine has."""
    sched_args: list[str] = ["--max-num-seqs", str(a.max_num_seqs),
                             "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                             "--block-size", str(a.block_size)]
    if a.num_kv_blocks is not None:
        sched_args += ["--num-kv-blocks", str(a.num_kv_blocks)]
    if a.no_chunked_prefill:
        sched_args.append("--no-chunked-prefill")
    if a.no_prefix_caching:
        sched_args.append("--no-prefix-caching")
    if a.async_scheduling is not None:
        sched_args.append("--async-scheduling" if a.async_scheduling
                          else "--no-async-scheduling")
    worker_args = ["--kv-cache-memory-gib", str(a.kv_cache_memory_gib)]
    if a.no_quant_kernels:
        worker_args.append("--no-quant-kernels")
    if a.cpu_level:
        worker_args += ["--cpu-level", a.cpu_level]
    if a.gpu_memory_utilization is not None:
        worker_args += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if a.enforce_eager:
        worker_args.append("--enforce-eager")
    devices = plan_devices(a.device, a.tp, a.pp, a.replicas, num_gpus)
    metrics_port = a.port + 5 if a.metrics_port is None else a.metrics_port
    control_port = a.port + 1 if a.control_port is None else a.control_port
    return ClusterSpec(model=a.model, host=a.host, port=a.port, control_port=control_port,
                       kv_plan_port=a.port + 2, kv_admin_port=a.port + 3,
                       kv_events_port=a.port + 4, kv_store_port=a.port + 6,
                       metrics_port=metrics_port, dtype=a.dtype,
                       tp=a.tp, pp=a.pp, num_replicas=a.replicas, scheduler_args=tuple(sched_args),
                       worker_args=tuple(worker_args), threads_per_worker=a.threads,
                       worker_devices=devices, log_level=a.log_level)


def _up(a: argparse.Namespace) -> int:
    try:
        spec = cluster_spec(a, 0 if a.device == "cpu" else visible_gpus())
    except DevicePlanError as exc:
        print(f"splitserve: {exc}", file=sys.stderr)
        return 2
    procs = ServiceProcesses(spec, Path(a.log_dir) if a.log_dir else None)
    if procs.token_chosen:
        # Refused here rather than by every service at once; a generated one always fits.
        try:
            cluster_token.load({cluster_token.ENV: procs.cluster_token})
        except cluster_token.TokenError as exc:
            print(f"splitserve: {exc}", file=sys.stderr)
            return 2
        print(f"splitserve: every service gets the cluster token from {cluster_token.ENV}",
              file=sys.stderr)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    procs.start()
    print(f"splitserve: starting kvcache_svc, scheduler_svc and {a.tp * a.pp * a.replicas} "
          f"worker(s) on {', '.join(dict.fromkeys(spec.worker_devices))}, serving on "
          f"{procs.address} (workers' control on {procs.control_address}) ...",
          file=sys.stderr)
    try:
        deadline = time.monotonic() + a.startup_timeout
        ready = False
        while not stopping:
            if dead := procs.dead():
                print(f"splitserve: a service exited: {dead}; stopping", file=sys.stderr)
                procs.stop()
                return 1
            if not ready:
                try:
                    procs.wait_ready(timeout_s=0.5)
                    ready = True
                    print(f"splitserve: ready on {procs.address} (Ctrl-C stops everything)",
                          file=sys.stderr)
                    if spec.metrics_port > 0:
                        print(f"splitserve: metrics on http://{a.host}:{spec.metrics_port}"
                              "/metrics", file=sys.stderr)
                except TimeoutError:
                    if time.monotonic() > deadline:
                        print("splitserve: not ready in time; stopping", file=sys.stderr)
                        procs.stop()
                        return 1
            time.sleep(0.5)
    except RuntimeError as exc:
        print(f"splitserve: {exc}; stopping", file=sys.stderr)
        procs.stop()
        return 1
    codes = procs.stop()
    print(f"splitserve: stopped ({', '.join(f'{n}={c}' for n, c in codes.items())})",
          file=sys.stderr)
    return 0


def _generate(a: argparse.Namespace) -> int:
    sampling = generation_pb2.SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature)
    if a.seed is not None:
        sampling.seed = a.seed
    request = generation_pb2.GenerateRequest(sampling=sampling)
    if a.raw:
        request.text = a.prompt
    else:
        request.chat.messages.add(role="user", content=a.prompt)
    with grpc.insecure_channel(a.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        token_ids: list[int] = []
        finish = ""
        try:
            for chunk in stub.Generate(request, timeout=a.timeout):
                token_ids.extend(chunk.token_ids)
                if not a.json:
                    print(chunk.text, end="", flush=True)
                if chunk.finish_reason:
                    finish = chunk.finish_reason
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if a.json:
        print(json.dumps({"token_ids": token_ids, "finish_reason": finish}))
    else:
        print()
    return 0


def fraction(text: str) -> float:
    """A share of a device's memory: above 0, at most 1."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start kvcache_svc, scheduler_svc and the workers")
    up.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M)")
    up.add_argument("--host", default="127.0.0.1",
                    help="interface of the client and metrics ports (the services' internal "
                         "sockets stay on 127.0.0.1)")
    up.add_argument("--port", type=int, default=50051, help="client gRPC port; kvcache_svc "
                    "takes PORT+2 (plan), +3 (admin gRPC), +4 (KV events), +6 (KV store)")
    up.add_argument("--control-port", type=int, default=None,
                    help="scheduler's control listener on 127.0.0.1, where workers register "
                         "(default PORT+1: 50052)")
    up.add_argument("--metrics-port", type=int, default=None,
                    help="scheduler Prometheus /metrics HTTP port (default PORT+5; -1: off)")
    up.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                    default="auto",
                    help="auto: bfloat16 on a GPU or a CPU with native bfloat16 dot products "
                         "(AVX512-BF16), float32 elsewhere; float16 on GPU workers only")
    up.add_argument("--device", default="auto",
                    help="workers' device: auto (cuda when torch sees a GPU, else cpu), cpu, "
                         "cuda (worker i on cuda:i; one GPU per worker, so tp x pp x replicas "
                         "must not exceed the GPUs) or cuda:N (one worker, on GPU N)")
    up.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                    help="GPU workers: fraction of the GPU's memory a worker may use for "
                         "weights, activations and KV cache (worker default 0.9)")
    up.add_argument("--enforce-eager", action="store_true",
                    help="GPU workers: no CUDA graphs, every step launched op by op")
    up.add_argument("--cpu-level", default=None,
                    help="workers' kernel instruction set: auto, avx512_bf16, avx512, avx2, none")
    up.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    up.add_argument("--pp", type=int, default=1, help="pipeline stages per replica")
    up.add_argument("--replicas", type=int, default=1)
    up.add_argument("--max-num-seqs", type=int, default=256)
    up.add_argument("--max-num-batched-tokens", type=int, default=2048)
    up.add_argument("--num-kv-blocks", type=int, default=None)
    up.add_argument("--block-size", type=int, default=16)
    up.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    up.add_argument("--no-chunked-prefill", action="store_true")
    up.add_argument("--no-prefix-caching", action="store_true")
    up.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                    default=None, help="plan the next step while one runs (default: on "
                                       "with --pp 1)")
    up.add_argument("--no-quant-kernels", "--no-int4-kernels", action="store_true",
                    help="run every matmul on dense weights (no small-step kernel on the "
                         "GGUF's quantized blocks)")
    up.add_argument("--threads", type=int, default=0,
                    help="threads per worker (0: this machine's CPUs divided among the workers)")
    up.add_argument("--startup-timeout", type=float, default=300.0)
    up.add_argument("--log-dir", default=None, help="write each service's log here")
    up.add_argument("--log-level", default="info")
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="stream a completion from a running cluster")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as raw text (default: one chat user message)")
    gen.add_argument("--json", action="store_true", help="print token ids and finish reason")
    gen.add_argument("--timeout", type=float, default=600.0)
    gen.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
