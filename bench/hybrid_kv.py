"""KV cache groups on a hybrid model: what one request's KV costs, and how many requests fit
one KV budget, with window-aware groups against every layer as full attention; one run.

    .venv/bin/python bench/hybrid_kv.py [--prompt-tokens 2000] [--max-tokens 128]
                                        [--window 512] [--layers 26] [--budget-gib 4]
                                        [--block-size 16] [--out FILE]

What it measures (about half a minute on 2 cores; no cluster, nothing timed: the services'
own sizing and bookkeeping, run in-process):

1. Sizing. A random-weight model with Gemma 3 1B's KV shape and layer pattern (26 layers,
   every sixth full attention and the rest a sliding window of --window tokens; 1 KV head of
   256 dims, bfloat16; Qwen3 architecture, a small hidden size: the weights do not matter
   here) is loaded by the worker's `ModelRunner` twice: as it is (its KV group layout,
   services.kv_groups) and with every layer made full attention (one group, a tensor per
   layer: the layout before groups). Each reports its KV bytes per block and the blocks
   --budget-gib holds, as a worker does at registration.
2. Bookkeeping. kvcache_svc's `ReplicaBlockManager` with that many blocks, driven by
   scheduler_svc's `Scheduler` (the services' plan and reply, in-process) through requests of
   --prompt-tokens random tokens (no shared prefixes) that each generate --max-tokens tokens
   (stand-in sampled ids), all submitted at once, token budget 8192 a step (a prompt is one
   prefill chunk). Per layout: the most blocks one decoding request held (every group; a
   sliding group's blocks are bounded by its window) and their bytes (KV per request), the
   most any request held (its prefill step, which writes all its prompt's KV in every group),
   the most requests decoding at once, and the preemptions (the scheduler admits a request
   when its prompt fits; decodes that outgrow the pool preempt the latest). "fit" is the
   budget's blocks over one decoding request's.

Prints the table and writes JSON to bench/results/hybrid_kv-<time>.json (or --out).
"""

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_io import write_result  # noqa: E402
from bench.throughput import cpu_info  # noqa: E402
from kvcache_svc.block_manager import ReplicaBlockManager  # noqa: E402
from scheduler_svc.engine.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine.request import Request, SamplingParams  # noqa: E402
from scheduler_svc.engine.scheduler import Scheduler  # noqa: E402
from scripts.random_family import build_family_model  # noqa: E402
from services.kv_groups import max_blocks_in_window  # noqa: E402
from services.model_config import ModelConfig, load_model_config  # noqa: E402
from services.wire import StepOutput, StepTimings  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

GIB = 1 << 30
STEP_TOKENS = 8192


def build_model(path: Path, num_layers: int, window: int, context: int) -> ModelConfig:
    layer_types = ["full_attention" if i % 6 == 5 else "sliding_attention"
                   for i in range(num_layers)]
    build_family_model(path, "qwen3", num_layers=num_layers, hidden_size=128,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, max_position_embeddings=context,
                       use_sliding_window=True, sliding_window=window,
                       layer_types=layer_types)
    return load_model_config(path)


@dataclass
class Layout:
    """One KV layout's figures: sizing (the worker's) and bookkeeping (the services')."""

    windows: tuple[int, ...]          # per KV group; 0 = full attention
    describe: str                     # the worker's sizing log line
    bytes_per_block: int              # one block id across the worker's KV tensors
    num_blocks: int                   # in the budget, null block included
    fit: int = 0                      # budget blocks // one decoding request's blocks
    most_blocks_per_request: int = 0  # held by one decoding request, every group
    most_blocks_in_prefill: int = 0   # held by one request in its prefill step
    most_sliding_group_blocks: int = 0
    most_decoding: int = 0            # requests decoding in one step
    preemptions: int = 0
    steps: int = 0

    @property
    def kv_bytes_per_request(self) -> int:
        return self.most_blocks_per_request * self.bytes_per_block


def sizing(config: ModelConfig, path: Path, block_size: int, budget: int) -> Layout:
    runner = ModelRunner(config, path, torch.bfloat16, "bench", kernels="torch")
    try:
        return Layout(runner.model.kv_layout.windows, runner.describe_kv(),
                      runner.kv_bytes_per_block(block_size),
                      runner.num_blocks_for_budget(budget, block_size))
    finally:
        runner.close()


def bookkeeping(layout: Layout, block_size: int, prompt_tokens: int, max_tokens: int,
                num_requests: int, context: int) -> None:
    """The scheduler and kvcache_svc's block manager through `num_requests` requests."""
    windows, num_blocks = layout.windows, layout.num_blocks
    config = SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=STEP_TOKENS,
                             block_size=block_size, max_model_len=context,
                             kv_group_windows=windows)
    sched = Scheduler(config)
    sched.set_capacity(num_blocks)
    kv = ReplicaBlockManager(num_blocks, block_size, True, group_windows=windows)
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(3, 50000) for _ in range(prompt_tokens)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                  ignore_eos=True),
                                  (2,), context, block_size, hash_blocks=True))
    sliding = [g for g, w in enumerate(windows) if w]
    while sched.has_work():
        step = sched.apply_plan(kv.apply(sched.schedule()))
        if step is None:
            continue
        layout.steps += 1
        # Decodes: one-token steps past the prompt (a resumed request's recompute is not one).
        decodes = {r.request_id for r in [*step.new_requests, *step.running]
                   if r.num_new_tokens == 1 and r.num_computed_tokens >= prompt_tokens}
        layout.most_decoding = max(layout.most_decoding, len(decodes))
        for request in sched.running:
            state = kv.requests[request.request_id]
            held = [sum(1 for b in table if b.block_id) for table in state.tables]
            layout.most_blocks_in_prefill = max(layout.most_blocks_in_prefill, sum(held))
            if request.request_id in decodes:
                layout.most_blocks_per_request = max(layout.most_blocks_per_request,
                                                     sum(held))
                layout.most_sliding_group_blocks = max(
                    [layout.most_sliding_group_blocks, *(held[g] for g in sliding)])
        samplers = [r.request_id for r in sched.running
                    if r.num_computed_tokens == r.num_tokens and r.num_in_flight]
        sched.update(StepOutput(step.step_id, "bench", samplers,
                                [rng.randrange(3, 50000) for _ in samplers],
                                [None] * len(samplers), StepTimings(0.0, 0.0, 0.0, 0)))
    layout.preemptions = sched.num_preemptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.perf_counter()
    context = 1 << (args.prompt_tokens + args.max_tokens).bit_length()
    budget = int(args.budget_gib * GIB)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hybrid"
        hybrid = build_model(path, args.layers, args.window, context)
        every_full = dataclasses.replace(hybrid, layer_windows=(0,) * hybrid.num_layers)
        rows = {name: sizing(config, path, args.block_size, budget)
                for name, config in (("window-aware groups", hybrid),
                                     ("every layer full", every_full))}
    request_blocks = -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    for row in rows.values():
        per_request = sum(request_blocks if w == 0 else min(
            request_blocks, max_blocks_in_window(w, args.block_size)) for w in row.windows)
        row.fit = (row.num_blocks - 1) // per_request
        bookkeeping(row, args.block_size, args.prompt_tokens, args.max_tokens, row.fit + 16,
                    context)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} (family/model {cpu['family_model']}, {cpu['cpus']} CPUs); "
          f"model: {args.layers} layers, every 6th full, window {args.window}, 1 KV head x "
          f"256, bfloat16; blocks of {args.block_size} tokens; budget {args.budget_gib:g} GiB; "
          f"requests of {args.prompt_tokens} + {args.max_tokens} tokens")
    for name, row in rows.items():
        print(f"  {name}: {row.describe}")
    print(f"{'layout':<21}{'groups':>7}{'B/block':>9}{'blocks':>8}{'blk/req':>8}"
          f"{'KV MiB/req':>11}{'prefill blk':>12}{'fit':>5}{'decoding':>9}{'preempt':>8}")
    for name, row in rows.items():
        print(f"{name:<21}{len(row.windows):>7}{row.bytes_per_block:>9}{row.num_blocks:>8}"
              f"{row.most_blocks_per_request:>8}{row.kv_bytes_per_request / (1 << 20):>11.2f}"
              f"{row.most_blocks_in_prefill:>12}{row.fit:>5}{row.most_decoding:>9}"
              f"{row.preemptions:>8}")
    aware, full = rows["window-aware groups"], rows["every layer full"]
    print(f"window-aware against every layer full: "
          f"{full.kv_bytes_per_request / aware.kv_bytes_per_request:.2f}x less KV per decoding "
          f"request, {aware.fit / full.fit:.2f}x the requests that fit "
          f"({aware.most_decoding / full.most_decoding:.2f}x decoding at once); a sliding group "
          f"held at most {aware.most_sliding_group_blocks} blocks in a decode (bound "
          f"{max_blocks_in_window(args.window, args.block_size)})")
    print(f"({time.perf_counter() - started:.0f} s)")
    write_result({"args": vars(args), "cpu": cpu,
                  "rows": {name: {**dataclasses.asdict(row),
                                  "kv_bytes_per_request": row.kv_bytes_per_request}
                           for name, row in rows.items()}}, args.out, "hybrid_kv")


if __name__ == "__main__":
    main()
