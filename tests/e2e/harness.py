"""End-to-end helpers: start the services as real processes on free ports, talk gRPC to them,
and compare with HF transformers (greedy, fp32, same GGUF weights) as the oracle."""

import random
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from services.cluster_token import call_metadata
from services.launcher import ClusterSpec, ServiceProcesses
from services.rpc.splitserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
)

TIE_MARGIN = 1e-3  # reference top-2 logits closer than this: either token is accepted


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """n distinct ports free now, taken below the kernel's ephemeral range: a port from that
    range can be taken by some process's outgoing connection before our service binds it
    (seen in CI as "Address already in use" for a port we had just found free)."""
    low = _ephemeral_range()[0]
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(10000, max(10001, low - 8))   # the CLI also takes port+1..+6
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@dataclass
class RunningCluster:
    """A started cluster and the test's channels to it: `stub` on the public port, `kv_admin`
    on kvcache_svc's admin port (its calls need `metadata=self.metadata`)."""

    procs: ServiceProcesses
    channel: grpc.Channel
    stub: generation_pb2_grpc.GenerationStub
    kv_admin: kvcache_pb2_grpc.KvCacheAdminStub
    log_dir: Path

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))

    @property
    def token(self) -> str:
        """The cluster token every service of this cluster was started with."""
        return self.procs.cluster_token

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """`metadata=` for a control-plane call (kvcache admin, WorkerControl)."""
        return call_metadata(self.token)

    @property
    def control_address(self) -> str:
        """The scheduler's control listener (WorkerControl), apart from the public port."""
        return self.procs.control_address

    def kv_stats(self) -> kvcache_pb2.StatsResponse:
        return self.kv_admin.Stats(kvcache_pb2.StatsRequest(), timeout=5,
                                   metadata=self.metadata)


@contextmanager
def run_cluster(log_dir: Path, *, scheduler_args: Sequence[str] = (),
                worker_args: Sequence[str] = (), kvcache_args: Sequence[str] = (),
                dtype: str = "float32", tp: int = 1,
                pp: int = 1, num_replicas: int = 1, env: dict[str, str] | None = None,
                ready_timeout_s: float = 180.0, model: str | None = None, http: bool = False
                ) -> Iterator[RunningCluster]:
    """The services as processes on free ports; `model`: a model path (default: the default
    model); `http`: the HTTP front end too (at `procs.http_address`, serving once the cluster
    is ready)."""
    port, control_port, plan_port, admin_port, events_port, metrics_port, store_port, \
        http_port = free_ports(8)
    spec = ClusterSpec(model=model, port=port, control_port=control_port,
                       kv_plan_port=plan_port, kv_admin_port=admin_port,
                       kv_events_port=events_port,
                       kv_store_port=store_port,
                       metrics_port=metrics_port, http_port=http_port if http else None,
                       dtype=dtype, tp=tp, pp=pp, num_replicas=num_replicas,
                       scheduler_args=tuple(scheduler_args),
                       worker_args=("--kv-cache-memory-gib", "0.25", *worker_args),
                       kvcache_args=tuple(kvcache_args),
                       env=dict(env or {}))
    procs = ServiceProcesses(spec, log_dir)
    procs.start()
    channel = grpc.insecure_channel(procs.address)
    admin = grpc.insecure_channel(f"127.0.0.1:{admin_port}")
    try:
        try:
            procs.wait_ready(ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{_read_logs(log_dir)}") from exc
        yield RunningCluster(procs, channel, generation_pb2_grpc.GenerationStub(channel),
                             kvcache_pb2_grpc.KvCacheAdminStub(admin), log_dir)
    finally:
        channel.close()
        admin.close()
        codes = procs.stop()
        stray = [n for n, p in procs.procs.items() if p.poll() is None]
        assert not stray, f"processes left running: {stray}"
        bad = {n: c for n, c in codes.items() if c not in (0, -15)}
        assert not bad, f"services exited badly: {bad}\n{_read_logs(log_dir)}"


def _read_logs(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(log_dir.glob("*")))


def hf_greedy_tokens(hf_model, prompt: Sequence[int],  # type: ignore[no-untyped-def]
                     max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt`, EOS ignored (as `greedy_request`)."""
    import torch

    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def greedy_request(token_ids: Sequence[int], max_tokens: int, request_id: str = "",
                   **sampling: object) -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True, **sampling)
    return generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=generation_pb2.TokenIds(ids=list(token_ids)),
        sampling=params)


def stream_tokens(stub: generation_pb2_grpc.GenerationStub,
                  request: generation_pb2.GenerateRequest, timeout: float = 300,
                  ) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
    """All token ids, the concatenated text, and the final chunk of one streamed request."""
    ids: list[int] = []
    text = ""
    last = None
    for chunk in stub.Generate(request, timeout=timeout):
        ids.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
    assert last is not None and last.finish_reason, "stream ended without a finish reason"
    return ids, text, last


class GreedyOracle:
    """An HF transformers model as the greedy reference: one token at a time with its cache,
    recording each step's top-1/top-2 logit margin for the near-tie rule; cached per (prompt,
    max_tokens). `HFOracle` (the GGUF, CPU) and tests/gpu's `CudaOracle` load the model."""

    def __init__(self, model, device: torch.device) -> None:  # type: ignore[no-untyped-def]
        self.model = model.eval()
        self.device = device
        self._cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """(tokens, top-1 minus top-2 logit at each step)."""
        key = (tuple(prompt), max_tokens)
        if key in self._cache:
            return self._cache[key]
        ids = torch.tensor([list(prompt)], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        tokens: list[int] = []
        margins: list[float] = []
        for _ in range(max_tokens):
            top2 = torch.topk(out.logits[0, -1].float(), 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            out = self.model(input_ids=top2.indices[:1].view(1, 1),
                             past_key_values=out.past_key_values, use_cache=True)
        self._cache[key] = (tokens, margins)
        return tokens, margins


class HFOracle(GreedyOracle):
    """HF transformers on the same GGUF, fp32, on the CPU."""

    def __init__(self, model_path: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        super().__init__(AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32),
            torch.device("cpu"))


def assert_matches_reference(ours: Sequence[int], ref: Sequence[int], margins: Sequence[float],
                             label: str = "") -> str:
    """Token-for-token equality, except that at a reference near-tie (top-2 logits within
    TIE_MARGIN) either token is accepted and the comparison stops there. Returns a note."""
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens, reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            if margins[i] < TIE_MARGIN:
                note = f"{label}: near-tie at step {i} (margin {margins[i]:.2e}); stopped there"
                warnings.warn(note, stacklevel=2)   # listed in pytest's warnings summary
                return note
            raise AssertionError(f"{label}: token {i} is {a}, reference {b} (margin "
                                 f"{margins[i]:.3f})\nours {list(ours)}\nref  {list(ref)}")
    return ""


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def no_children_left(pids: Sequence[int]) -> bool:
    out = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, pids))],
                         capture_output=True, text=True)
    return not out.stdout.strip()
