"""Our AMX matmul kernels against the other matmuls of their dtype, at one row count after
another. bfloat16 (the default): gemm_amx.c against oneDNN's AMX matmul through torch and our
AVX512-BF16 kernel (gemm_bf16.c), on pre-packed bfloat16 weights. float32 (`--dtype float32`):
gemm_amx_quant.c on random Q4_1 blocks (Q8_0 for the LM head, as the default model's) against
gemm_fma.c and torch's float32 matmul (MKL) on the same weights dequantized. bfloat16 on blocks
(`--dtype blocks`): gemm_amx.c's block entry (gemm_amx_blocks) on random Q4_1 blocks (Q8_0 for
the LM head) against gemm_amx.c and oneDNN on the same weights dequantized to bfloat16.

    .venv/bin/python bench/amx_gemm.py [--dtype bfloat16] [--rounds 5] [--layers 30]
                                       [--threads 2] [--rows 1,8,64] [--shapes qkv,o]
                                       [--quiet-wait 30] [--out FILE]

SmolLM2's five weight shapes, each with `--layers` distinct weights (2 for the LM head) so that
they stream from memory as in a model step, not from cache. Per (shape, rows): every system
times a step over all the weights, in rounds that rotate the systems' order (the machine is
shared and noisy); the table holds the medians of the rounds, in GFLOP/s. Before each
measurement the bench waits (up to `--quiet-wait` seconds) until no other task is running
(/proc/stat's procs_running): two threads on two cores lose whole time slices at every OpenMP
barrier when a third process runs, which swamps any kernel difference. The JSON keeps every
round and how many had to start without a quiet machine. Each system's packed
weight is made once, before timing:

- onednn: `torch.ops.mkldnn._reorder_linear_weight(w, 64)`, then `_linear_pointwise` (what
  worker_svc.model.llama.Linear runs);
- avx512_bf16: worker_svc.kernels.gemm.Bf16Gemm (VDPBF16PS);
- amx: worker_svc.kernels.gemm_amx.AmxGemm (TDPBF16PS);
- blocks: amx_blocks (worker_svc.kernels.gemm_amx.AmxBlocksGemm), beside onednn and amx;
- float32: fma (worker_svc.kernels.gemm.FmaGemm), mkl (`torch.nn.functional.linear`),
  amx_quant (worker_svc.kernels.gemm_amx_quant.AmxQuantGemm).

Writes a JSON result to bench/results/. Needs a CPU with AMX.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_io import write_result  # noqa: E402

from worker_svc.kernels.cpu import CpuLevel, cpu_flags, cpu_model, detect_level  # noqa: E402
from worker_svc.kernels.gemm import bf16_gemm, fma_gemm  # noqa: E402
from worker_svc.kernels.gemm_amx import amx_blocks_gemm, amx_gemm  # noqa: E402
from worker_svc.kernels.gemm_amx_quant import amx_quant_gemm  # noqa: E402
from worker_svc.kernels.quant_blocks import QuantBlocks  # noqa: E402

# (name, out_features, in_features) of SmolLM2's matmuls
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048]
SYSTEMS = {"bfloat16": ["onednn", "avx512_bf16", "amx"], "float32": ["mkl", "fma", "amx_quant"],
           "blocks": ["onednn", "amx", "amx_blocks"]}
BASELINE = {"bfloat16": "onednn", "float32": "fma", "blocks": "amx"}  # the last column's divisor
MIN_SECONDS = 0.03   # per measurement: whole steps until at least this long


def running_tasks() -> int:
    """Tasks running or runnable now, this process's reading thread included."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running"):
            return int(line.split()[1])
    return 1


def wait_quiet(seconds: float) -> bool:
    """Waits until this process is the only one running (True), or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while True:
        time.sleep(0.01)   # lets this process's own OpenMP threads stop spinning
        if running_tasks() <= 1:
            return True
        if time.monotonic() > deadline:
            return False


def over_all(kernel: Callable[..., object], x: torch.Tensor, packed: list[object]
             ) -> Callable[[], None]:
    """A step: kernel(x, w) for every packed weight w."""

    def step() -> None:
        for w in packed:
            kernel(x, w)
    return step


def step_fns(weights: list[torch.Tensor], x: torch.Tensor
             ) -> dict[str, Callable[[], None]]:
    """Each system's step: x times every weight, from that system's packed copies."""
    bf16, amx = bf16_gemm(CpuLevel.AVX512_BF16), amx_gemm(CpuLevel.AMX)
    assert bf16 is not None and amx is not None, "a kernel did not build (see the log)"
    assert bf16.fits(weights[0]) and amx.fits(weights[0])
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    ours = [bf16.pack(w) for w in weights]
    tiles = [amx.pack(w) for w in weights]
    run_onednn = over_all(
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), x, onednn)
    run_bf16, run_amx = over_all(bf16, x, ours), over_all(amx, x, tiles)

    # the three agree on the first weight (a wrong kernel would make its timing meaningless)
    ref = x.float() @ weights[0].float().T
    for out in (torch.ops.mkldnn._linear_pointwise(x, onednn[0], None, "none", [], ""),
                bf16(x, ours[0]), amx(x, tiles[0])):
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-2)
    return {"onednn": run_onednn, "avx512_bf16": run_bf16, "amx": run_amx}


def random_blocks(n: int, k: int, bits: int, gen: torch.Generator) -> QuantBlocks:
    """Q4_1-like (bits 4) or Q8_0-like (bits 8) blocks with float16-representable scales."""
    blocks = k // 32
    scales = (torch.rand(n, blocks, generator=gen) * 0.02 + 1e-3).half().float()
    if bits == 4:
        return QuantBlocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen), scales,
                           -(torch.rand(n, blocks, generator=gen) * 0.1).half().float(), 4)
    return QuantBlocks(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen), scales,
                       torch.zeros(n, blocks), 8)


def dequantized(b: QuantBlocks) -> torch.Tensor:
    return (b.scales.repeat_interleave(32, 1) * b.values.float()
            + b.offsets.repeat_interleave(32, 1))


def float32_step_fns(blocks: list[QuantBlocks], x: torch.Tensor
                     ) -> dict[str, Callable[[], None]]:
    """float32: the FMA kernel and MKL on the dequantized weights, the AMX kernel on the
    blocks."""
    fma, amx_quant = fma_gemm(CpuLevel.AVX512, torch.float32), amx_quant_gemm(CpuLevel.AMX)
    assert fma is not None and amx_quant is not None, "a kernel did not build (see the log)"
    dense = [dequantized(b) for b in blocks]
    packed = [fma.pack(w) for w in dense]
    tiles = [amx_quant.pack(b) for b in blocks]
    ref = x.double() @ dense[0].double().T
    for out in (fma(x, packed[0]), amx_quant(x, tiles[0])):
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)
    return {"mkl": over_all(torch.nn.functional.linear, x, dense),
            "fma": over_all(fma, x, packed), "amx_quant": over_all(amx_quant, x, tiles)}


def blocks_step_fns(blocks: list[QuantBlocks], x: torch.Tensor
                    ) -> dict[str, Callable[[], None]]:
    """bfloat16 on blocks: gemm_amx_blocks on the blocks, gemm_amx.c and oneDNN on the same
    weights dequantized to bfloat16 (which gemm_amx_blocks must equal bit for bit)."""
    dense = [dequantized(b).bfloat16() for b in blocks]
    fns = step_fns(dense, x)
    kernel = amx_blocks_gemm(CpuLevel.AMX, blocks[0].bits)
    assert kernel is not None, "gemm_amx.c did not build (see the log)"
    packed = [kernel.pack(b) for b in blocks]
    amx = amx_gemm(CpuLevel.AMX)
    assert amx is not None and torch.equal(kernel(x, packed[0]), amx(x, amx.pack(dense[0])))
    return {"onednn": fns["onednn"], "amx": fns["amx"], "amx_blocks": over_all(kernel, x, packed)}


def seconds_per_step(fn: Callable[[], None]) -> float:
    fn()   # warm: first touch, oneDNN's primitive cache
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < MIN_SECONDS or count == 0:
        fn()
        count += 1
    return elapsed / count


def bench(shapes: list[tuple[str, int, int]], rows: list[int], layers: int, rounds: int,
          quiet_wait: float, dtype: str) -> list[dict]:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(0)
    results = []
    systems, base = SYSTEMS[dtype], BASELINE[dtype]
    ours = systems[-1]
    for name, n, k in shapes:
        count = 2 if name == "lm_head" else layers
        if dtype in ("float32", "blocks"):
            weights = [random_blocks(n, k, 8 if name == "lm_head" else 4, gen)
                       for _ in range(count)]
        else:
            weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(count)]
        print(f"\n{name} {n}x{k}, {count} weights, GFLOP/s (medians of {rounds} rounds)")
        print(f"{'rows':>5} " + " ".join(f"{s:>12}" for s in systems) + f"  {ours}/{base}")
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            if dtype == "float32":
                fns = float32_step_fns(weights, x)  # type: ignore[arg-type]
            elif dtype == "blocks":
                fns = blocks_step_fns(weights, x.bfloat16())  # type: ignore[arg-type]
            else:
                fns = step_fns(weights, x.bfloat16())  # type: ignore[arg-type]
            gflop = 2 * m * n * k * count / 1e9
            samples: dict[str, list[float]] = {s: [] for s in systems}
            noisy = 0
            for r in range(rounds):
                order = systems[r % len(systems):] + systems[:r % len(systems)]
                for system in order:
                    noisy += not wait_quiet(quiet_wait)
                    samples[system].append(gflop / seconds_per_step(fns[system]))
            med = {s: statistics.median(v) for s, v in samples.items()}
            results.append({"shape": name, "n": n, "k": k, "rows": m, "weights": count,
                            "noisy_samples": noisy,
                            **{f"{s}_gflops": med[s] for s in systems},
                            **{f"{s}_rounds": samples[s] for s in systems}})
            print(f"{m:>5} " + " ".join(f"{med[s]:>12.1f}" for s in systems)
                  + f"  {med[ours] / med[base]:>9.2f}x"
                  + (f"  ({noisy} of {rounds * len(systems)} not quiet)" if noisy else ""),
                  flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(SYSTEMS), default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="seconds to wait for no other running task before each measurement")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if detect_level() < CpuLevel.AMX:
        raise SystemExit(f"needs a CPU with AMX (this is {cpu_model()}, level "
                         f"{detect_level().label})")
    torch.set_num_threads(a.threads)
    wanted = a.shapes.split(",")
    shapes = [s for s in SHAPES if s[0] in wanted]
    rows = [int(r) for r in a.rows.split(",")]
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    print(f"{cpu_model()}; {a.threads} threads; flags {' '.join(flags)}")
    result = {"cpu": cpu_model(), "flags": flags, "threads": a.threads, "layers": a.layers,
              "rounds": a.rounds, "quiet_wait": a.quiet_wait, "dtype": a.dtype,
              "matmul": bench(shapes, rows, a.layers, a.rounds, a.quiet_wait, a.dtype)}
    write_result(result, a.out, "amx-gemm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
