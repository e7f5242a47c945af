"""`--quantization int8`'s matmul (worker_svc.kernels.gemm_int8) against the dense paths a model
uses today, then a model step with and without it.

    .venv/bin/python bench/int8_gemm.py [--rounds 5] [--layers 30] [--threads 2]
                                        [--rows 1,16,64,256,2048] [--shapes qkv,o]
                                        [--quiet-wait 5]
                                        [--context 256] [--skip-model] [--out FILE]

Matmuls: SmolLM2's four decoder-layer shapes (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576), each with `--layers` distinct weights so that a step streams them from memory
as a model step does. Every system is worker_svc.model.llama.Linear as the model builds it at
this CPU's best level, so each runs the path the model would take:
- int8: Linear with the int8 kernel (AMX-INT8 at level amx, else AVX512-VNNI), bfloat16 in
  and out (int8_f32: the same kernel, float32 in and out);
- bf16: the bfloat16 model's Linear (gemm_bf16.c / gemm_amx.c for small steps, oneDNN on a
  pre-packed weight beyond);
- fp32: the float32 model's Linear (gemm_fma.c).
Per (shape, rows) the systems are timed in rounds that rotate their order (the machine is
shared), waiting up to `--quiet-wait` seconds for no other running task before each
(bench/amx_gemm.py's rule); the table holds the medians, in ms per step over all weights,
and bf16 / int8 and fp32 / int8.

Model: the default GGUF (SmolLM2-135M, Q4_1 layers) in bfloat16, one decode step of 64
sequences (64 rows, each with `--context` tokens already cached) and of one sequence, logits
included, medians of the rounds in ms, for three models: bf16 (dense bfloat16 weights, as
`--no-quant-kernels` or a bfloat16 checkpoint), bf16_q4 (a worker's default on this GGUF:
steps of up to 8 rows on its Q4_1 blocks, torch's int4 kernel, dense beyond) and int8.

Writes a JSON result to bench/results/.
"""

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from amx_gemm import seconds_per_step, wait_quiet  # noqa: E402
from bench_io import write_result  # noqa: E402

from worker_svc.kernels import LayerKernels, load_cpu_kernels, with_int8  # noqa: E402
from worker_svc.kernels.cpu import cpu_flags, cpu_model, detect_level  # noqa: E402
from worker_svc.model.llama import Linear  # noqa: E402

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
ROWS = [1, 16, 64, 256, 2048]
SYSTEMS = ["int8", "int8_f32", "bf16", "fp32"]


def _kernels(dtype: torch.dtype, int8: bool) -> LayerKernels:
    kernels = load_cpu_kernels(detect_level(), 64, 3, dtype)
    return with_int8(kernels) if int8 else kernels


def _timed(fns: dict[str, Callable[[], object]], rounds: int, quiet_wait: float
           ) -> tuple[dict[str, float], dict[str, list[float]], int]:
    """Medians (seconds) of each fn over rotating rounds; the rounds; how many were not quiet."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    noisy = 0
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            noisy += not wait_quiet(quiet_wait)
            samples[name].append(seconds_per_step(fns[name]))  # type: ignore[arg-type]
    return {name: statistics.median(v) for name, v in samples.items()}, samples, noisy


def _over_all(linears: list[Linear], x: torch.Tensor) -> Callable[[], object]:
    """A step: x times every weight."""
    return lambda: [linear(x) for linear in linears]


def _decode_step(model, ids, meta, caches) -> Callable[[], object]:  # type: ignore[no-untyped-def]
    """One model step on these rows, logits included."""
    def run() -> object:
        with torch.inference_mode():
            hidden, residual = model.forward(ids, None, None, meta.positions, meta, caches)
            return model.compute_logits(hidden, residual)
    return run


def bench_matmuls(shapes: list[tuple[str, int, int]], rows: list[int], layers: int,
                  rounds: int, quiet_wait: float) -> list[dict]:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(0)
    kernels = {"int8": _kernels(torch.bfloat16, True), "int8_f32": _kernels(torch.float32, True),
               "bf16": _kernels(torch.bfloat16, False), "fp32": _kernels(torch.float32, False)}
    dtypes = {"int8": torch.bfloat16, "int8_f32": torch.float32, "bf16": torch.bfloat16,
              "fp32": torch.float32}
    results = []
    for name, n, k in shapes:
        weights = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(layers)]
        linears = {s: [Linear([w.to(dtypes[s])], None, kernels[s], int8=s.startswith("int8"))
                       for w in weights] for s in SYSTEMS}
        print(f"\n{name} {k}->{n}, {layers} weights, ms a step (medians of {rounds} rounds)")
        print(f"{'rows':>5} " + " ".join(f"{s:>9}" for s in SYSTEMS) + "  bf16/int8 fp32/int8")
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            inputs = {s: x.to(dtypes[s]) for s in SYSTEMS}
            # a wrong kernel would make its timing meaningless: each near float32's product
            ref = x @ weights[0].T
            for s in SYSTEMS:
                out = linears[s][0](inputs[s]).float()
                assert (out - ref).norm() <= 0.03 * ref.norm(), f"{s} is off at {m} rows"
            fns = {s: _over_all(linears[s], inputs[s]) for s in SYSTEMS}
            med, samples, noisy = _timed(fns, rounds, quiet_wait)
            ms = {s: med[s] * 1e3 for s in SYSTEMS}
            results.append({"shape": name, "n": n, "k": k, "rows": m, "weights": layers,
                            "noisy_samples": noisy, **{f"{s}_ms": ms[s] for s in SYSTEMS},
                            **{f"{s}_rounds_s": samples[s] for s in SYSTEMS}})
            print(f"{m:>5} " + " ".join(f"{ms[s]:>9.3f}" for s in SYSTEMS)
                  + f"  {ms['bf16'] / ms['int8']:>8.2f}x {ms['fp32'] / ms['int8']:>8.2f}x"
                  + (f"  ({noisy} not quiet)" if noisy else ""), flush=True)
    return results


def bench_model(rounds: int, quiet_wait: float, context: int) -> list[dict]:  # type: ignore[type-arg]
    from services.model_config import load_model_config
    from tests.conftest import default_model_path
    from worker_svc.attention import build_attention_metadata
    from worker_svc.kv_cache import KvLayerSpec, allocate_kv_caches
    from worker_svc.model.llama import LlamaModel
    from worker_svc.model.weights import ModelWeights, load_weights

    path = default_model_path()
    config = load_model_config(path)
    weights = load_weights(path, config, torch.bfloat16)
    dense = ModelWeights(weights.tensors)               # no blocks: every step dense
    models = {}
    for label, int8, loaded in (("bf16", False, dense), ("bf16_q4", False, weights),
                                ("int8", True, dense)):
        models[label] = LlamaModel(config, torch.bfloat16, kernels=_kernels(torch.bfloat16, int8))
        models[label].load_weights(loaded)
    block_size, results = 16, []
    for seqs in (64, 1):
        per_seq = -(-(context + 1) // block_size)
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(seqs)]
        num_blocks = 1 + seqs * per_seq
        meta = build_attention_metadata([1] * seqs, [context] * seqs, tables, block_size,
                                        num_blocks)
        spec = KvLayerSpec(block_size, config.num_kv_heads, config.head_dim, torch.bfloat16)
        caches = allocate_kv_caches([spec] * config.num_layers, num_blocks)
        ids = torch.randint(0, config.vocab_size, (seqs,))
        med, samples, noisy = _timed({label: _decode_step(m, ids, meta, caches)
                                      for label, m in models.items()}, rounds, quiet_wait)
        print(f"decode step, {seqs} rows, context {context}: "
              + ", ".join(f"{label} {med[label] * 1e3:.2f} ms" for label in models)
              + f"; bf16/int8 {med['bf16'] / med['int8']:.2f}x, bf16_q4/int8 "
              f"{med['bf16_q4'] / med['int8']:.2f}x" + (f" ({noisy} not quiet)" if noisy else ""),
              flush=True)
        results.append({"rows": seqs, "context": context, "noisy_samples": noisy,
                        **{f"{label}_ms": med[label] * 1e3 for label in models},
                        **{f"{label}_rounds_s": samples[label] for label in models}})
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    p.add_argument("--quiet-wait", type=float, default=5.0)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    level = detect_level()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    print(f"{cpu_model()}; level {level.label}; {a.threads} threads; flags {' '.join(flags)}")
    result = {"cpu": cpu_model(), "level": level.label, "flags": flags, "threads": a.threads,
              "layers": a.layers, "rounds": a.rounds, "quiet_wait": a.quiet_wait,
              "int8_kernel": type(_kernels(torch.bfloat16, True).int8).__name__,
              "matmul": bench_matmuls([s for s in SHAPES if s[0] in a.shapes.split(",")],
                                      [int(r) for r in a.rows.split(",")], a.layers, a.rounds,
                                      a.quiet_wait)}
    if not a.skip_model:
        result["model"] = bench_model(a.rounds, a.quiet_wait, a.context)
    write_result(result, a.out, "int8-gemm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
