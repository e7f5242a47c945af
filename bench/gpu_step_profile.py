"""Where a worker's decode step goes on a GPU: host work, GPU work, and what waits on what.

    python3 bench/gpu_step_profile.py [--model DIR | --shape smollm2] [--rows 1,64]
                                      [--context 176] [--steps 40] [--dtype bfloat16]

One process, a `ModelRunner` on the device (no services), the shape's random model
(scripts/random_model.py, built once under --models-dir), driven by hand-made steps like
bench/step_profile.py: `rows` requests of `context` tokens prefilled, then decode steps. Per
row count, with CUDA graphs and without (`enforce_eager`):

- `execute_ms`: one step launched and finished (the host waits for its tokens) — the step's
  wall time when nothing overlaps;
- `ahead_ms`: steps in the worker's order under launch-ahead (step N+1 launched before step N
  is finished) — what the runner alone sustains, the ceiling for the service's step;
- host parts per step, wall time on the host: `apply` (the input batch takes the step's diff),
  `metadata` (attention metadata to the device), `input_ids`, `forward` (queueing the layers,
  or one graph replay), `sample` (queueing the LM head and argmax), `finish` (waiting for
  the tokens, the `StepOutput`);
- `forward_gpu_ms`: CUDA events around the forward: with graphs, the replay's GPU time;
- the top GPU kernels of an eager step (torch.profiler), microseconds per step.

The service's own cost (scheduler, messages, kvcache_svc) is what bench/throughput.py's
`batch_forward_gap_ms` adds on top. Prints a table and writes a JSON result (--out, or
bench/results/gpu-step-profile-*.json). On a CPU (`--device cpu`) it runs the same steps
without graphs or events, which is how it is checked without a GPU.
"""

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from bench_io import write_result  # noqa: E402
from step_profile import hand_made_requests  # noqa: E402

from services.model_config import load_model_config  # noqa: E402
from services.wire import RunningRequest, StepInput  # noqa: E402
from worker_svc import runner as runner_module  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK = 16
HOST_PARTS = ("apply", "metadata", "input_ids", "forward", "sample", "finish")


class HostTimers:
    """Host wall time per part, and GPU time around the forward (CUDA events), per step."""

    def __init__(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu
        self.ms: dict[str, float] = defaultdict(float)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, part: str, fn: Callable, gpu_span: bool = False) -> Callable:  # type: ignore[type-arg]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            begin_event = None
            if gpu_span and self.on_gpu:
                begin_event = torch.cuda.Event(enable_timing=True)
                begin_event.record()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[part] += (time.perf_counter() - start) * 1e3
                if begin_event is not None:
                    end_event = torch.cuda.Event(enable_timing=True)
                    end_event.record()
                    self.events.append((begin_event, end_event))
        return timed

    def take(self) -> tuple[dict[str, float], float]:
        """The parts' host ms since the last take, and the forwards' GPU ms (waits for them)."""
        ms, self.ms = dict(self.ms), defaultdict(float)
        gpu_ms = 0.0
        for begin, end in self.events:
            end.synchronize()
            gpu_ms += begin.elapsed_time(end)
        self.events = []
        return ms, gpu_ms


def instrument(runner: ModelRunner, timers: HostTimers) -> Callable[[], None]:
    """Times the runner's parts through its own objects (no change to its code); returns
    what undoes it (some parts are patched on their classes, which have __slots__)."""
    undo: list[Callable[[], None]] = []

    def patch(owner: object, name: str, part: str, gpu_span: bool = False) -> None:
        """Wraps owner.name; on its class when the instance takes no attributes (__slots__)."""
        original = getattr(owner, name)
        try:
            setattr(owner, name, timers.wrap(part, original, gpu_span))
            undo.append(lambda: setattr(owner, name, original))
            return
        except AttributeError:
            pass
        cls = type(owner)
        unbound = cls.__dict__[name]
        setattr(cls, name, timers.wrap(part, unbound, gpu_span))
        undo.append(lambda: setattr(cls, name, unbound))

    assert runner.input_batch is not None
    patch(runner.input_batch, "apply", "apply")
    patch(runner, "_attention_metadata", "metadata")
    patch(runner._pending_tokens, "input_ids", "input_ids")
    patch(runner.model, "forward", "forward", gpu_span=True)
    if runner.graphs is not None:
        patch(runner.graphs, "run", "forward", gpu_span=True)
    patch(runner_module, "sample_step", "sample")
    patch(runner, "finish", "finish")

    def restore() -> None:
        for step in reversed(undo):
            step()
    return restore


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_rows(model_dir: Path, dtype: torch.dtype, device: torch.device, rows: int,
                 context: int, steps: int, eager: bool) -> dict[str, object]:
    config = load_model_config(model_dir)
    runner = ModelRunner(config, model_dir, dtype, "gpu-profile", device=device,
                         enforce_eager=eager)
    per_request = -(-(context + 3 * steps + 8) // BLOCK)
    runner.init_cache(rows * per_request + 1, BLOCK, max_num_seqs=max(rows, 1))
    blocks, new = hand_made_requests(config.vocab_size, rows, context, per_request)
    step_id = 0
    for start in range(0, rows, 16):
        runner.execute(StepInput(step_id, new[start:start + 16], [], []))
        step_id += 1
    length = context

    def decode() -> StepInput:
        nonlocal step_id, length
        step = StepInput(step_id, [], [RunningRequest(rid, length, 1, [[]], [])
                                       for rid in blocks], [])
        step_id += 1
        length += 1
        return step

    for _ in range(3):                       # warm-up (first replays, allocator)
        runner.execute(decode())
    sync(device)
    # One step at a time.
    timers = HostTimers(device.type == "cuda")
    restore = instrument(runner, timers)
    timers.take()
    execute_ms, gpu_ms, parts = [], [], defaultdict(float)
    for _ in range(steps):
        start = time.perf_counter()
        runner.execute(decode())
        execute_ms.append((time.perf_counter() - start) * 1e3)
        ms, forward_gpu = timers.take()
        gpu_ms.append(forward_gpu)
        for key, value in ms.items():
            parts[key] += value / steps
    # Launch-ahead, as the worker runs: launch N+1, then finish N.
    sync(device)
    start = time.perf_counter()
    launched = runner.launch(decode())
    for _ in range(steps - 1):
        following = runner.launch(decode())
        runner.finish(launched)
        launched = following
    runner.finish(launched)
    sync(device)
    ahead_ms = (time.perf_counter() - start) * 1e3 / steps
    timers.take()
    kernels: list[dict[str, object]] = []
    if device.type == "cuda" and eager:
        kernels = top_kernels(runner, decode, steps=10)
    restore()
    graphs = runner.graphs is not None
    runner.close()
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    execute_ms.sort()
    gpu_ms.sort()
    return {"rows": rows, "graphs": graphs, "execute_ms": execute_ms[len(execute_ms) // 2],
            "ahead_ms": ahead_ms,
            "forward_gpu_ms": gpu_ms[len(gpu_ms) // 2] if device.type == "cuda" else None,
            "host_ms": {p: parts.get(p, 0.0) for p in HOST_PARTS}, "top_kernels": kernels}


def top_kernels(runner: ModelRunner, decode: Callable[[], StepInput], steps: int
                ) -> list[dict[str, object]]:
    """The eager step's GPU kernels by total time, microseconds per step (top 12)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.execute(decode())
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total = totals[event.name]
            total[0] += event.device_time
            total[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    whole = sum(v[0] for v in totals.values()) / steps
    out = [{"kernel": "(all kernels)", "us_per_step": whole, "calls_per_step": sum(
        v[1] for v in totals.values()) / steps}]
    out += [{"kernel": name[:90], "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps}
            for name, v in ranked[:12]]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF model directory (default: --shape)")
    p.add_argument("--shape", default="smollm2", help="random-weight shape (random_model.py)")
    p.add_argument("--models-dir", default=str(ROOT / "models" / "random"))
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for the random model")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="1,64", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=176)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-eager", action="store_true", help="graphs only (no eager rows)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    if a.model is not None:
        model_dir = Path(a.model)
    else:
        from random_model import build_model
        model_dir = build_model(Path(a.models_dir) / a.shape, a.shape, dtype=a.dtype
                                if a.dtype != "float16" else "bfloat16",
                                tokenizer=Path(a.tokenizer) if a.tokenizer else None)
    dtype = getattr(torch, a.dtype)
    modes = [False] if device.type != "cuda" else ([False] if a.no_eager else [False, True])
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        for eager in modes:
            results.append(profile_rows(model_dir, dtype, device, rows, a.context, a.steps,
                                        eager))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    from worker_svc.triton_kernels import paged_attention as triton_attention
    dot = triton_attention._DOT
    print(f"\n{name}, {model_dir.name}, {a.dtype}, context {a.context}, {a.steps} steps "
          f"(medians; host parts are means); attention products: {'tl.dot' if dot else 'sums'}")
    print(f"{'rows':>5} {'graphs':>7} {'execute':>8} {'ahead':>7} {'fwd GPU':>8}  "
          + " ".join(f"{p:>9}" for p in HOST_PARTS))
    for r in results:
        gpu = r["forward_gpu_ms"]
        print(f"{r['rows']:>5} {r['graphs']!s:>7} {r['execute_ms']:>8.3f} {r['ahead_ms']:>7.3f} "
              f"{'-' if gpu is None else format(gpu, '.3f'):>8}  "
              + " ".join(f"{r['host_ms'][p]:>9.3f}" for p in HOST_PARTS))  # type: ignore[index]
    for r in results:
        if r["top_kernels"]:
            print(f"\ntop kernels, eager, {r['rows']} rows (us per step, calls per step):")
            for k in r["top_kernels"]:  # type: ignore[attr-defined]
                print(f"  {k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  {k['kernel']}")
    write_result({"device": name, "model": model_dir.name, "dtype": a.dtype, "dot_attention": dot,
                  "context": a.context, "steps": a.steps, "results": results},
                 a.out, f"gpu-step-profile-{a.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
