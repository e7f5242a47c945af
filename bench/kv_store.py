"""kvcache_svc's KV store: time to first token when a long prefix is loaded from the store
instead of recomputed, and what the store costs on the shared workload; one invocation.

    .venv/bin/python bench/kv_store.py [--quick] [--questions 3] [--doc-tokens 2000]
                                       [--repeats 2] [--skip-throughput]
                                       [--skip-whole-loads] [--skip-scenarios] [--out FILE]
                                       [--skip-ttft] [--throughput-dtype bfloat16]

About 10 minutes on 2 cores (Intel Xeon, family 6 model 207): 3 clusters of ~1 minute of
TTFT each, 1.5 minutes of further scenarios (3 below), 40 s per workload run.

1. TTFT. A document prompt of about --doc-tokens tokens (real text: the shared workload's
   sentences as numbered notes, in the system message of the model's chat template), then
   --questions short user questions after it, each streamed greedily (4 tokens). One cluster
   with the store on (the default) and one with it off (kvcache_svc --no-kv-store, given through
   the environment as SPLITSERVE_KV_NO_STORE=1: the test harness passes kvcache_svc no flag, and
   the workers' `--kv-store ""`), each with 2 replicas (1 thread per worker on 2 cores) and
   `--route-tokens-per-request 100000`. After an untimed warm-up of both replicas:
   (a) cold: the first question on the fresh cluster (replica 0); "warm" rows: the other
       questions with the document still in replica 0's blocks (device prefix cache);
   (b) evicted: before each question, kvcache admin Clear of replica 0's pool; with the store
       the document's chunks are loaded (a store hit), without it recomputed;
   (c) second replica: one long decode keeps replica 0 busy, so the router (score = cached or
       stored prefix tokens - 100000 x live requests) sends each question to replica 1, whose
       pool is cleared before each question (always a first sight of the document there).
   Each row is the median over the questions; the ratio is store off / store on (target: >= 20x
   for (b) and (c), issue 24). A third cluster, store on with --no-layerwise-kv-loads ("whole":
   a hit loads whole, then the rest of its prompt is computed in a later step), shows what
   layer-wise loads (the default: the hit's step computes as each layer's KV lands) gain; not
   with --skip-whole-loads. Then, on the store-on cluster, the transfer alone for comparison:
   as many bytes as (b)'s hits, random chunks saved under a model name no worker uses, fetched
   back by the worker's own ChunkFetcher (checked, not copied into blocks); (b)'s TTFT over
   that says how close a hit comes to its transfer time (issue 24, point 2). Which replica
   served a question is read from kvcache_svc's per-pool counters (admitted prompt tokens), its
   store hits, loads and load fallbacks from ServerInfo.
2. The seeds' 32-token prompt, a 10-turn chat re-sending its history, and hits read from the
   disk tier, each on fresh one-replica clusters (bench/kv_store_scenarios.py has the detail).
3. Throughput on the shared workload (../shared/bench, as bench/throughput.py runs it: 64
   prompts x 128 tokens all at once, float32, a fresh cluster per run), store on and off in
   alternation, --repeats runs each; ratio of the medians (target: within 3 %). Its prompts
   all differ, so the store serves no hit: this is the store's overhead alone (saving each
   prompt's KV as a partial chunk). --quick: the first 16 prompts only (said so in the
   output), for slower machines; the full workload fits in a minute per run here.

Prints the CPU (model, vector flags, the workers' kernel level) and a table; writes JSON to
bench/results/kv_store-<time>.json (or --out). This file builds the prompts and reports; the
clusters and what is measured on them are in bench/kv_store_runs.py."""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import load_workload, medians, write_result  # noqa: E402
from kv_store_runs import (  # noqa: E402
    ANSWER_TOKENS,
    DTYPE,
    ROUTE_WEIGHT,
    throughput_run,
    ttft_cluster,
    workload_module,
)
from kv_store_scenarios import SEEDS_TOKENS, report_scenarios, run_scenarios  # noqa: E402
from throughput import CPU_FLAGS, cpu_info  # noqa: E402

from scheduler_svc.frontend.tokenizer import ChatMessage, load_tokenizer  # noqa: E402
from services.model_config import default_model_path  # noqa: E402

QUESTIONS = ["When does the train to the mountains leave?",
             "Which note mentions honeybees, and what do they do?",
             "What does a good cup of coffee depend on?",
             "Where does the chess club meet?",
             "What do astronomers study with large telescopes?"]


def document_prompts(doc_tokens: int, num_questions: int) -> tuple[list[str], list[int]]:
    """Chat-template texts (system: the document, user: a question) of about `doc_tokens`
    tokens each, and their token counts."""
    workload = workload_module()
    tok = load_tokenizer(default_model_path())

    def render(notes: int, question: str) -> str:
        lines = [f"Note {i + 1}: {workload.SENTENCES[i % len(workload.SENTENCES)]}"
                 for i in range(notes)]
        document = "Answer the question from these notes.\n" + "\n".join(lines)
        return tok.render_chat([ChatMessage("system", document),
                                ChatMessage("user", question)], True)

    notes = 1
    while len(tok.encode(render(notes, QUESTIONS[0]))) < doc_tokens:
        notes += 1
    texts = [render(notes, q) for q in QUESTIONS[:num_questions]]
    return texts, [len(tok.encode(t)) for t in texts]


# ------------------------------------------------------------------------------- reporting

def median_ttft(rows: list[dict[str, object]]) -> float:
    return statistics.median(float(r["ttft_ms"]) for r in rows)  # type: ignore[arg-type]


def evidence(rows: list[dict[str, object]]) -> str:
    return "; ".join(f"r{r['replica']} cached {r.get('cached', '?')} store hit "
                     f"{r.get('hit', '?')} loaded {r.get('loaded', '?')} "
                     f"fallbacks {r.get('fallbacks', '?')}" for r in rows)


def report_ttft(results: dict[str, object]) -> None:
    on, off = results["ttft_store_on"], results["ttft_store_off"]
    whole = results.get("ttft_store_on_whole")
    assert isinstance(on, dict) and isinstance(off, dict)
    print(f"\nTTFT, document prompts of {results['prompt_tokens']} tokens, "
          f"{results['num_questions']} question(s), median ms (2 replicas, 1 thread each); "
          f"store on: layer-wise loads; whole: --no-layerwise-kv-loads")
    print(f"{'case':<44}{'store on':>10}{'whole':>8}{'store off':>11}{'off/on':>8}"
          f"{'whole/on':>10}")
    ratios: dict[str, float] = {}
    layerwise: dict[str, float] = {}
    for key, label in (("cold", "(a) cold, fresh cluster (1 question)"),
                       ("warm", "    warm, document in replica's blocks"),
                       ("evicted", "(b) after Clear of replica's blocks"),
                       ("second_replica", "(c) second replica (replica 0 busy)")):
        if not on[key]:
            continue
        a, b = median_ttft(on[key]), median_ttft(off[key])
        w = median_ttft(whole[key]) if isinstance(whole, dict) else float("nan")
        ratio = b / a
        if key in ("evicted", "second_replica"):
            ratios[key] = ratio
            layerwise[key] = w / a
        print(f"{label:<44}{a:>10.0f}{w:>8.0f}{b:>11.0f}{ratio:>7.1f}x{w / a:>9.2f}x")
    results["ttft_ratio_off_on"] = ratios
    results["ttft_ratio_whole_layerwise"] = layerwise
    transfer = on.get("transfer")
    if isinstance(transfer, dict):
        evicted_ms = median_ttft(on["evicted"])  # type: ignore[arg-type]
        print(f"transfer alone: {transfer['num_bytes'] / 1e6:.0f} MB ({transfer['num_tokens']} "
              f"tokens' KV, {transfer['num_chunks']} chunks) fetched from the store by the "
              f"worker's fetcher, checked, in {transfer['fetch_ms']:.0f} ms (median of 3 after "
              f"2 untimed); (b)'s first token took {evicted_ms / transfer['fetch_ms']:.1f}x that")
    ok = all(r >= 20 for r in ratios.values())
    print(f"target >= 20x for (b) and (c): {'met' if ok else 'NOT met'}")
    sides = [("store on", on), ("store off", off)]
    if isinstance(whole, dict):
        sides.insert(1, ("store on, whole loads", whole))
    for name, side in sides:
        for key in ("evicted", "second_replica"):
            print(f"  {name} {key}: {evidence(side[key])}")  # type: ignore[arg-type]
    print(f"  store on, replica {on['second_replica_id']} served (c) while replica "
          f"{on['busy_replica']} decoded; ServerInfo replicas: "
          + ", ".join(f"r{r['replica_id']} loaded {r['num_store_loaded_tokens']} "
                      f"fallbacks {r['num_store_load_fallbacks']}"
                      for r in on["replicas"]))  # type: ignore[union-attr]
    for name, side in sides:
        print(f"  {name} anomalies: {side['anomalies'] or 'none'}")
    print(f"  ServerInfo kv_store (store on): {on['kv_store']}")
    print(f"  ServerInfo kv_store (store off): {off['kv_store']}")
    for name, side in sides:
        problems = side["log_problems"]
        print(f"  {name} service logs: {len(problems)} suspicious line(s)")  # type: ignore[arg-type]
        for line in problems[:10]:  # type: ignore[index]
            print(f"    {line}")


def report_throughput(results: dict[str, object]) -> None:
    tp_on, tp_off = results["throughput_store_on"], results["throughput_store_off"]
    assert isinstance(tp_on, dict) and isinstance(tp_off, dict)
    ratio = tp_on["batch_tok_s"] / tp_off["batch_tok_s"]
    results["throughput_ratio_on_off"] = ratio
    print(f"\nshared workload{' (--quick: a subset)' if results['quick'] else ''}: "
          f"{results['num_prompts']} prompts x {results['max_tokens']} tokens, "
          f"{results['throughput_dtype']}, "
          f"median of {results['repeats']} run(s) each, alternating")
    print(f"{'store':<12}{'all at once tok/s':>18}  runs")
    for name, side in (("on", tp_on), ("off", tp_off)):
        runs = ", ".join(f"{r['batch_tok_s']:.1f}" for r in side["runs"])
        print(f"{name:<12}{side['batch_tok_s']:>18.1f}  {runs}")
    print(f"ratio on/off: {ratio:.3f} (target within 3 %: "
          f"{'met' if abs(ratio - 1) <= 0.03 else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="throughput on the first 16 shared prompts only (not the workload)")
    p.add_argument("--questions", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    p.add_argument("--doc-tokens", type=int, default=2000,
                   help="document prompt length in tokens (at least)")
    p.add_argument("--repeats", type=int, default=2, help="throughput runs per store setting")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--throughput-dtype", choices=["float32", "bfloat16"], default=DTYPE,
                   help="the workload runs' dtype (the TTFT clusters run float32)")
    p.add_argument("--skip-ttft", action="store_true",
                   help="the throughput runs only (no TTFT clusters, no scenarios)")
    p.add_argument("--skip-whole-loads", action="store_true",
                   help="no cluster loading hits whole before computing (the comparison "
                        "for layer-wise loads, --no-layerwise-kv-loads)")
    p.add_argument("--skip-scenarios", action="store_true",
                   help="no seeds' prompt, chat or disk tier clusters (kv_store_scenarios.py)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.skip_scenarios = a.skip_scenarios or a.skip_ttft     # their ratios need the TTFT runs
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))

    cpu = cpu_info()
    print(f"cpu: {cpu['model']} (family/model {cpu['family_model']}), {cpu['cpus']} cpus, "
          + ", ".join(f"{f} {'yes' if cpu[f] else 'no'}" for f in CPU_FLAGS), flush=True)
    texts, lengths = document_prompts(a.doc_tokens, a.questions)
    results: dict[str, object] = {"dtype": DTYPE, "cpu": cpu, "quick": a.quick,
                                  "prompt_tokens": lengths, "num_questions": a.questions,
                                  "answer_tokens": ANSWER_TOKENS,
                                  "route_tokens_per_request": float(ROUTE_WEIGHT)}
    log_root = Path(tempfile.mkdtemp(prefix="splitserve-kvstore-bench-"))
    for store, layerwise, name in ((True, True, "on"), (True, False, "on_whole"),
                                   (False, True, "off")):
        if a.skip_ttft or (name == "on_whole" and a.skip_whole_loads):
            continue
        start = time.perf_counter()
        side = ttft_cluster(store, texts, log_root / f"store-{name}", layerwise)
        results[f"ttft_store_{name}"] = side
        print(f"TTFT, store {name}: done in {time.perf_counter() - start:.0f} s "
              f"(logs in {log_root / f'store-{name}'})", flush=True)
    if not a.skip_scenarios:
        tok = load_tokenizer(default_model_path())
        results["scenarios"] = run_scenarios(texts, tok.encode(texts[0])[:SEEDS_TOKENS],
                                             log_root)
    if not a.skip_ttft:
        levels = {r["cpu_level"]
                  for r in results["ttft_store_on"]["replicas"]}  # type: ignore[index]
        results["cpu_level"] = sorted(levels)
        print(f"workers' kernel level: {', '.join(sorted(levels))}", flush=True)

    if not a.skip_throughput:
        prompts, single, max_tokens = load_workload()
        prompts = prompts[:16] if a.quick else prompts
        results.update({"num_prompts": len(prompts), "max_tokens": max_tokens,
                        "repeats": a.repeats, "throughput_dtype": a.throughput_dtype})
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for i in range(a.repeats):
            for store in ((True, False) if i % 2 == 0 else (False, True)):
                start = time.perf_counter()
                runs[store].append(throughput_run(store, prompts, single, max_tokens,
                                                  a.throughput_dtype))
                print(f"throughput run {i + 1}/{a.repeats} store {'on' if store else 'off'}: "
                      f"{runs[store][-1]['batch_tok_s']:.1f} tok/s "
                      f"({time.perf_counter() - start:.0f} s with start-up)", flush=True)
        results["throughput_store_on"] = medians(runs[True])
        results["throughput_store_off"] = medians(runs[False])
    if not a.skip_ttft:
        report_ttft(results)
    if not a.skip_scenarios:
        results["scenario_ratios"] = report_scenarios(
            results["scenarios"],  # type: ignore[arg-type]
            median_ttft(results["ttft_store_on"]["evicted"]),  # type: ignore[index]
            median_ttft(results["ttft_store_off"]["evicted"]))  # type: ignore[index]
    if not a.skip_throughput:
        report_throughput(results)
    write_result(results, a.out, "kv_store")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
