"""`bench/throughput.py --device cuda`: the shared workload on one GPU, per model shape.

For each shape (scripts/random_model.py: random weights in the SmolLM2-135M and Llama-3.2-1B
shapes, built once under --models-dir and reused, or --model DIR):
1. splitserve, `--repeats` rounds, each on a fresh cluster whose worker runs `--device cuda`
   in --dtype; the timed figures as on the CPU (splitserve_runs.bench_splitserve), plus the GPU
   idle share between steps over the batched run (the workers' gap metric).
2. HF transformers on the same GPU (gpu_peers.HfCudaPeer), eager and then static cache +
   torch.compile, each loaded once and run `--repeats` rounds, then freed.

Unlike the CPU run, the systems do not take turns: a worker sizes its KV cache from the GPU's
memory at start, so nothing else may hold GPU memory then, and the compiled peer compiles
once per load (minutes) rather than once per round. A GPU is not shared with other jobs the
way the CPU machines' cores are, so round order matters less there.

Prints a table per shape with issue 13's targets beside splitserve's figures and writes one
JSON result (every shape, medians and rounds) to bench/results/throughput-cuda-<dtype>-*.json.
Never prints a figure it did not measure: a skipped system has no row.
"""

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_io import medians, write_result  # noqa: E402
from random_model import SHAPES, build_model  # noqa: E402
from splitserve_runs import BATCH_APIS, batch_apis, bench_splitserve  # noqa: E402

# Start-up on a GPU includes memory profiling, Triton compiles and CUDA-graph capture.
READY_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Target:
    """Issue 13's goal for a shape on an H100 (bf16, the shared workload)."""

    batch_tok_s: float              # all prompts at once, tokens/s
    single_decode_tok_s: float      # one stream's decode, tokens/s
    max_idle_fraction: float = 0.10  # GPU idle between steps, share of the batched run


TARGETS = {"smollm2": Target(30_000, 600), "llama-1b": Target(20_000, 500)}


def check_shapes(shapes: str, model: str | None) -> list[str]:
    """The shape names to run (--model DIR: that directory's name, the one entry)."""
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--model {model}: not an HF directory (no config.json)")
        return [Path(model).name]
    names = [s.strip() for s in shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        raise ValueError(f"--shapes: unknown {unknown or shapes!r}; known: {', '.join(SHAPES)}")
    return names


def gpu_info() -> dict[str, object]:
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gib": round(props.total_memory / (1 << 30), 1),
            "count": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__}


def prepare_model(a: argparse.Namespace, shape: str) -> Path:
    if a.model is not None:
        return Path(a.model)
    print(f"model {shape}: building (or reusing) random weights in {a.models_dir}", flush=True)
    return build_model(Path(a.models_dir) / shape, shape, dtype="bfloat16",
                       tokenizer=Path(a.tokenizer) if a.tokenizer else None)


def run_shape(a: argparse.Namespace, model_dir: Path, prompts: list[str], single: str,
              max_tokens: int) -> tuple[dict[str, list[dict[str, float]]], bool | None]:
    """Every system's rounds on one model; and whether HF's compiled peer really compiled."""
    from gpu_peers import HfCudaPeer

    # The warm-up sends other texts than the timed prompts, so that those find nothing of
    # theirs in the prefix cache; all of them at once, so that every batch size is seen.
    warmup = [f"(warm-up {i}) {p}" for i, p in enumerate(prompts)]
    apis = batch_apis(a.batch_api or "stream")
    runs: dict[str, list[dict[str, float]]] = {BATCH_APIS[api]: [] for api in apis}
    for round_no in range(1, a.repeats + 1):
        for api in apis:
            name = BATCH_APIS[api]
            runs[name].append(bench_splitserve(
                prompts, single, max_tokens, a.dtype, a.scheduler_arg,
                ["--device", "cuda", *a.worker_arg], model=str(model_dir),
                warmup_prompts=warmup, ready_timeout_s=READY_TIMEOUT_S, batch_api=api))
            report_round(round_no, a.repeats, name, runs[name][-1])
    compiled: bool | None = None
    peers = [] if a.skip_hf else [("hf eager", False)] + (
        [] if a.skip_compile else [("hf static+compile", True)])
    for name, is_compiled in peers:
        peer = HfCudaPeer(model_dir, a.dtype, is_compiled)
        try:
            runs[name] = []
            for round_no in range(1, a.repeats + 1):
                runs[name].append(peer.run(prompts, single, max_tokens))
                report_round(round_no, a.repeats, name, runs[name][-1])
            if is_compiled:
                compiled = peer.compile_happened()
        finally:
            peer.close()
    return runs, compiled


def report_round(round_no: int, repeats: int, name: str, figures: dict[str, float]) -> None:
    print(f"round {round_no}/{repeats} {name}: {figures['batch_tok_s']:.0f} tok/s all at once, "
          f"{figures['single_decode_tok_s']:.0f} single decode", flush=True)


def verdicts(figures: dict[str, object], target: Target) -> dict[str, bool]:
    """splitserve's medians against the target, figure by figure."""
    return {"batch_tok_s": float(figures["batch_tok_s"]) >= target.batch_tok_s,  # type: ignore[arg-type]
            "single_decode_tok_s":
                float(figures["single_decode_tok_s"]) >= target.single_decode_tok_s,  # type: ignore[arg-type]
            "batch_idle_fraction":
                float(figures["batch_idle_fraction"]) < target.max_idle_fraction}  # type: ignore[arg-type]


def print_table(shape: str, table: dict[str, dict[str, object]], target: Target | None,
                heading: str) -> None:
    print(f"\n{shape}: {heading}")
    print(f"{'system':<20}{'all at once tok/s':>19}{'single decode tok/s':>21}"
          f"{'single TTFT ms':>16}{'GPU idle between steps':>24}")
    for name, r in table.items():
        idle = r.get("batch_idle_fraction")
        idle_text = f"{float(idle) * 100:.1f} %" if idle is not None else "-"  # type: ignore[arg-type]
        print(f"{name:<20}{float(r['batch_tok_s']):>19.0f}"  # type: ignore[arg-type]
              f"{float(r['single_decode_tok_s']):>21.0f}"  # type: ignore[arg-type]
              f"{float(r['single_ttft_ms']):>16.1f}{idle_text:>24}")  # type: ignore[arg-type]
    if target is not None:
        print(f"{'target (issue 13)':<20}{'>= ' + format(target.batch_tok_s, ',.0f'):>19}"
              f"{'>= ' + format(target.single_decode_tok_s, ',.0f'):>21}{'':>16}"
              f"{'< ' + format(target.max_idle_fraction * 100, '.0f') + ' %':>24}")


def run_cuda(a: argparse.Namespace, shapes: list[str], prompts: list[str], single: str,
             max_tokens: int) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA GPU here "
                         f"(CUDA build: {torch.version.cuda or 'no'})")
    gpu = gpu_info()
    print(f"gpu: {gpu['name']} ({gpu['memory_gib']} GiB), torch {gpu['torch']}, "
          f"CUDA {gpu['cuda']}, transformers {gpu['transformers']}", flush=True)
    smoke = " (fewer prompts than the workload: a smoke check)" if len(prompts) < 64 else ""
    results: dict[str, object] = {
        "device": "cuda", "gpu": gpu, "dtype": a.dtype, "weights": "random",
        "num_prompts": len(prompts), "max_tokens": max_tokens, "repeats": a.repeats,
        "scheduler_args": a.scheduler_arg, "worker_args": a.worker_arg}
    per_shape: dict[str, object] = {}
    results["shapes"] = per_shape
    for shape in shapes:
        model_dir = prepare_model(a, shape)
        runs, compiled = run_shape(a, model_dir, prompts, single, max_tokens)
        table = {name: medians(r) for name, r in runs.items()}
        target = TARGETS.get(shape)
        entry: dict[str, object] = {"model_dir": str(model_dir), "hf_compiled": compiled,
                                    **{name.replace(" ", "_").replace("+", "_"): figures
                                       for name, figures in table.items()}}
        ours = next(n for n in table if n.startswith("splitserve"))   # streamed if it ran
        hf_names = [n for n in table if n.startswith("hf")]
        if hf_names:
            best = max(hf_names, key=lambda n: float(table[n]["batch_tok_s"]))  # type: ignore[arg-type]
            entry["ratio_batch_vs_best_hf"] = {
                "against": best, "ratio": float(table[ours]["batch_tok_s"])  # type: ignore[arg-type]
                / float(table[best]["batch_tok_s"])}  # type: ignore[arg-type]
        heading = (f"random weights, {a.dtype}, {len(prompts)} prompts x {max_tokens} tokens, "
                   f"median of {a.repeats} round(s); {gpu['name']}{smoke}")
        print_table(shape, table, target, heading)
        if compiled is False:
            print("note: transformers did not compile the decode step; the static+compile row "
                  "ran eagerly")
        if target is not None:
            met = verdicts(table[ours], target)
            entry["target"] = asdict(target)
            entry["meets_target"] = met
            print(f"{ours} against the target: " + ", ".join(
                f"{key} {'met' if ok else 'MISSED'}" for key, ok in met.items()))
        per_shape[shape] = entry
    write_result(results, a.out, f"throughput-cuda-{a.dtype}")
    return 0
