"""The split's own cost per decode step: the service's full-batch decode step against the
worker's step alone on the same work, measured in alternation in one invocation.

    .venv/bin/python bench/split_cost.py [--dtype bfloat16] [--rounds 3] [--level amx]
                                         [--batch-api stream|once] [--store-ab] [--out FILE]

This machine's speed drifts by tens of percent within minutes (the same worker-alone step has
measured 49 and 77 ms an hour apart), so a service figure from one run and a worker figure from
another say little about the split. Here every round runs both, back to back:

1. service: a fresh cluster (bench/splitserve_runs.bench_splitserve, as bench/throughput.py)
   runs the shared workload's 64 prompts at once; its decode step is the mean interval while
   all 64 decode, from the client's token arrival times (`full_batch_step_ms`; with
   `--batch-api once` the client takes whole replies but for one streamed probe). The CPU
   seconds of the scheduler, kvcache_svc and the client over the batch run are the split's
   own share of the machine.
2. alone: a `ModelRunner` in a fresh process (same model, dtype, CPU level and threads as the
   worker) prefills 64 requests of the workload's prompt lengths, then decodes them the
   workload's tokens, blocks handed out as the service does (a prompt's at admission, then one
   whenever a request crosses into a new block, interleaved across requests); its decode step
   is the mean wall time of `execute` over those steps.

The cluster is stopped before the alone part starts, so each half has the machine to itself;
the two go in turns (service first in odd rounds, alone first in even ones). With
`--store-ab` every round also runs the service without the KV store (the worker's
`--kv-store ""`), so the store's share of the split's cost comes from the same rounds.
Writes a JSON result to bench/results/.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from worker_svc.process_env import apply_worker_env  # noqa: E402

apply_worker_env()      # as a worker process runs (before torch loads)

import torch  # noqa: E402
from bench_io import load_workload, write_result  # noqa: E402
from splitserve_runs import BATCH_APIS, bench_splitserve  # noqa: E402

from scheduler_svc.frontend.tokenizer import load_tokenizer  # noqa: E402
from services.model_config import default_model_path, load_model_config  # noqa: E402
from services.wire import NewRequest, RunningRequest, SamplingSpec, StepInput  # noqa: E402
from worker_svc.kernels.cpu import CpuLevel, cpu_flags, cpu_model, detect_level  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK = 16
PREFILL_PER_STEP = 16      # prompts per prefill step (only the decode steps are timed)
KEY_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
GREEDY = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=None, num_logprobs=None)


def decode_alone(runner: ModelRunner, prompt_lens: list[int], new_tokens: int) -> float:
    """Mean ms of the decode steps of `prompt_lens` requests generating `new_tokens` each."""
    need = sum(-(-(n + new_tokens) // BLOCK) for n in prompt_lens)
    runner.init_cache(need + 1, BLOCK, max_num_seqs=len(prompt_lens))
    gen = torch.Generator().manual_seed(0)
    next_block = 1
    blocks: dict[str, list[int]] = {}
    new = []
    for i, n in enumerate(prompt_lens):
        rid = f"r{i}"
        count = -(-(n + 1) // BLOCK)        # the prompt and its first sampled token
        blocks[rid] = list(range(next_block, next_block + count))
        next_block += count
        ids = torch.randint(0, runner.config.vocab_size, (n,), generator=gen).tolist()
        new.append(NewRequest(rid, ids, n, GREEDY, [blocks[rid]], 0, n))
    step_id = 0
    for start in range(0, len(new), PREFILL_PER_STEP):
        runner.execute(StepInput(step_id, new[start:start + PREFILL_PER_STEP], [], []))
        step_id += 1
    times = []
    for j in range(new_tokens - 1):          # the first token came with the prefill
        running = []
        for i, n in enumerate(prompt_lens):
            rid, computed = f"r{i}", n + j
            grown: list[int] = []
            if computed + 1 > len(blocks[rid]) * BLOCK:     # crosses into a new block
                grown = [next_block]
                blocks[rid].append(next_block)
                next_block += 1
            running.append(RunningRequest(rid, computed, 1, [grown], []))
        start = time.perf_counter()
        runner.execute(StepInput(step_id, [], running, []))
        times.append((time.perf_counter() - start) * 1e3)
        step_id += 1
    return statistics.mean(times)


def alone_child(dtype: str, level: CpuLevel, threads: int, prompt_lens: list[int],
                new_tokens: int) -> float:
    """`decode_alone` in a fresh process, as the worker is one: nothing of this process (its
    gRPC client's threads, its heap) touches the measurement."""
    args = [sys.executable, str(Path(__file__).resolve()), "--alone", "--dtype", dtype,
            "--level", level.label, "--threads", str(threads), "--new-tokens", str(new_tokens),
            "--prompt-lens", ",".join(map(str, prompt_lens))]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--level", default=None, help="CPU level (default: the best detected)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="the worker's (torch's) threads")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="passed to the scheduler (repeatable)")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="passed to the worker (repeatable)")
    p.add_argument("--store-ab", action="store_true",
                   help="each round also runs the service without the KV store")
    p.add_argument("--out", default=None)
    p.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)   # the child
    p.add_argument("--prompt-lens", default="", help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--batch-api", choices=list(BATCH_APIS), default="stream",
                   help="the service's batch client: streams (Generate) or takes whole replies "
                   "(GenerateOnce) but for one streamed probe of the step times")
    a = p.parse_args()
    level = CpuLevel.parse(a.level or "") or detect_level()
    path = default_model_path()
    if a.alone:
        torch.set_num_threads(a.threads)
        runner = ModelRunner(load_model_config(path), path, getattr(torch, a.dtype), "alone",
                             cpu_level=level)
        lens = [int(n) for n in a.prompt_lens.split(",")]
        print(decode_alone(runner, lens, a.new_tokens))
        return 0
    prompts, single, max_tokens = load_workload()
    tokenizer = load_tokenizer(path)
    prompt_lens = [len(tokenizer.encode(text)) for text in prompts]
    worker_args = ["--cpu-level", level.label, *a.worker_arg]
    flags = sorted(cpu_flags() & KEY_FLAGS)
    print(f"{cpu_model()} ({' '.join(flags)}), level {level.label}, {a.dtype}, "
          f"{a.threads} threads; {len(prompts)} prompts of {min(prompt_lens)}-"
          f"{max(prompt_lens)} tokens, {max_tokens} new tokens each", flush=True)
    rounds = []
    arms = {"service": worker_args}
    if a.store_ab:
        arms["no_store"] = [*worker_args, "--kv-store", ""]
    for r in range(a.rounds):
        # The service first in odd rounds, alone first (and the service arms reversed) in even
        # ones: a drift of the machine's speed within a round then favours no side over them.
        order = [*arms, "alone"] if not r % 2 else ["alone", *reversed(arms)]
        runs = {}
        for arm in order:
            if arm == "alone":
                alone = alone_child(a.dtype, level, a.threads, prompt_lens, max_tokens)
            else:
                runs[arm] = bench_splitserve(prompts, single, max_tokens, a.dtype,
                                             a.scheduler_arg, arms[arm], batch_api=a.batch_api)
        row = {"alone_step_ms": alone}
        for arm, service in runs.items():
            prefix = "" if arm == "service" else f"{arm}_"
            cpu = service["batch_cpu_s"]
            split_cpu = sum(v for name, v in cpu.items() if not name.startswith("worker"))
            row |= {f"{prefix}service_step_ms": service["batch_decode_step_ms"],
                    f"{prefix}ratio": service["batch_decode_step_ms"] / alone,
                    f"{prefix}split_cpu_share": split_cpu / sum(cpu.values()),
                    f"{prefix}idle_fraction": service["batch_idle_fraction"],
                    f"{prefix}batch_tok_s": service["batch_tok_s"],
                    f"{prefix}batch_cpu_s": cpu}
        rounds.append(row)
        for prefix, what in (("", "service"), ("no_store_", "without the store")):
            if f"{prefix}ratio" in row:
                print(f"round {r + 1}/{a.rounds}: {what} step {row[f'{prefix}service_step_ms']:.1f}"
                      f" ms, alone {alone:.1f} ms: {row[f'{prefix}ratio']:.3f}x; the split's CPU "
                      f"{100 * row[f'{prefix}split_cpu_share']:.1f} %, workers idle between "
                      f"forwards {100 * row[f'{prefix}idle_fraction']:.1f} %", flush=True)
    keys = [key for key in ("service_step_ms", "alone_step_ms", "ratio", "split_cpu_share",
                            "idle_fraction", "no_store_service_step_ms", "no_store_ratio",
                            "no_store_split_cpu_share", "no_store_idle_fraction")
            if key in rounds[0]]
    median = {key: statistics.median(row[key] for row in rounds) for key in keys}
    print(f"\nmedians of {a.rounds} rounds: service {median['service_step_ms']:.1f} ms, alone "
          f"{median['alone_step_ms']:.1f} ms, service / alone {median['ratio']:.3f} (ratios "
          f"{', '.join(format(row['ratio'], '.3f') for row in rounds)})")
    if a.store_ab:
        print(f"without the store: {median['no_store_service_step_ms']:.1f} ms, / alone "
              f"{median['no_store_ratio']:.3f} (ratios "
              f"{', '.join(format(row['no_store_ratio'], '.3f') for row in rounds)})")
    write_result({"cpu": cpu_model(), "flags": flags, "level": level.label,
                  "dtype": a.dtype, "threads": a.threads, "prompt_lens": prompt_lens,
                  "max_tokens": max_tokens, "rounds": rounds, "median": median},
                 a.out, "split-cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
