"""kvcache_svc's KV store: time to first token when a long prefix is loaded from the store
instead of recomputed, and what the store costs on the shared workload; one invocation.

    .venv/bin/python bench/kv_store.py [--quick] [--questions 3] [--doc-tokens 2000]
                                       [--repeats 2] [--skip-throughput] [--out FILE]

About 6 minutes on 2 cores (AMD EPYC Zen 2, AVX2): 2 minutes of TTFT, 40 s per workload run.

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
   Each row is the median over the questions; the ratio is store off / store on (target: >= 5x
   for (b) and (c)). Which replica served a question is read from kvcache_svc's per-pool
   counters (admitted prompt tokens), its store hits, loads and load fallbacks from ServerInfo.
2. Throughput on the shared workload (../shared/bench, as bench/throughput.py runs it: 64
   prompts x 128 tokens all at once, float32, a fresh cluster per run), store on and off in
   alternation, --repeats runs each; ratio of the medians (target: within 3 %). Its prompts are
   shorter than a 256-token chunk, so the store can hold none of them: this is the store's
   overhead alone. --quick: the first 16 prompts only (said so in the output), for slower
   machines; the full workload fits in a minute per run here.

Prints the CPU (model, vector flags, the workers' kernel level) and a table; writes JSON to
bench/results/kv_store-<time>.json (or --out)."""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_io import load_workload, medians, write_result  # noqa: E402
from splitserve_runs import bench_splitserve, request, run_batch, run_stream  # noqa: E402
from throughput import CPU_FLAGS, cpu_info  # noqa: E402

from scheduler_svc.tokenizer import ChatMessage, load_tokenizer  # noqa: E402
from services.model_config import default_model_path  # noqa: E402
from services.rpc.splitserve.v1 import generation_pb2, kvcache_pb2  # noqa: E402
from tests.e2e.harness import RunningCluster, run_cluster, wait_for  # noqa: E402

DTYPE = "float32"
ANSWER_TOKENS = 4             # TTFT is the point; a few tokens prove the stream goes on
BUSY_TOKENS = 4000            # replica 0's long decode in (c), cancelled when (c) is done
ROUTE_WEIGHT = "100000"       # --route-tokens-per-request: one live request outweighs any hit
QUESTIONS = ["When does the train to the mountains leave?",
             "Which note mentions honeybees, and what do they do?",
             "What does a good cup of coffee depend on?",
             "Where does the chess club meet?",
             "What do astronomers study with large telescopes?"]
# Store off: kvcache_svc runs none (its --no-kv-store, by environment: the harness passes
# kvcache_svc no extra flag) and the workers save nowhere (a later --kv-store wins).
STORE_OFF_ENV = {"SPLITSERVE_KV_NO_STORE": "1"}
STORE_OFF_WORKER_ARGS = ("--kv-store", "")


def workload_module():  # type: ignore[no-untyped-def]
    """shared/bench/workload.py as a module (load_workload puts its folder on sys.path)."""
    load_workload()
    import workload  # type: ignore[import-not-found]

    return workload


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


# ---------------------------------------------------------------------------- part 1: TTFT

def server_info(c: RunningCluster) -> generation_pb2.ServerInfoResponse:
    return c.stub.ServerInfo(generation_pb2.ServerInfoRequest(), timeout=10)


def replica_counters(c: RunningCluster) -> dict[int, dict[str, int]]:
    return {r.replica_id: {"hit": r.num_store_hit_tokens, "loaded": r.num_store_loaded_tokens,
                           "fallbacks": r.num_store_load_fallbacks,
                           "running": r.num_running}
            for r in server_info(c).replicas}


def pool_counters(c: RunningCluster) -> dict[int, tuple[int, int]]:
    """Per replica (kvcache_svc's pools): admitted prompt tokens (who admitted a request) and,
    of those, tokens found in the replica's own blocks."""
    return {p.replica_id: (p.num_queries, p.num_hits) for p in c.kv_stats().pools}


def settle_store(c: RunningCluster) -> None:
    """Waits until the workers' saves stop arriving (no change in 0.5 s, at most 20 s)."""
    def saved() -> tuple[int, int]:
        store = c.kv_stats().store
        return store.num_stored_chunks, store.num_skipped_tokens

    if not c.kv_stats().HasField("store"):
        return
    last, deadline = saved(), time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if (now := saved()) == last:
            return
        last = now


def evict(c: RunningCluster, replica_id: int) -> int:
    """Admin Clear of the replica's pool once no request holds blocks there (a request whose
    stream just ended may still reference its blocks for a moment, and Clear keeps those);
    checks that no cached block is left."""
    def pool() -> kvcache_pb2.PoolStats:
        return next(p for p in c.kv_stats().pools if p.replica_id == replica_id)

    if not wait_for(lambda: pool().num_requests == 0, 30):
        raise RuntimeError(f"replica {replica_id} still holds requests: {pool()}")
    reply = c.kv_admin.Clear(kvcache_pb2.ClearRequest(replica_id=replica_id), timeout=10,
                             metadata=c.metadata)
    if pool().num_cached_blocks:
        raise RuntimeError(f"Clear left cached blocks on replica {replica_id}: {pool()}")
    return reply.num_cleared


def measure(c: RunningCluster, prompt: str) -> dict[str, object]:
    """One question's TTFT, the replica that admitted it and its store counters' growth."""
    before, pools = replica_counters(c), pool_counters(c)
    n, ttft, _ = run_stream(c.stub, prompt, ANSWER_TOKENS)
    assert n == ANSWER_TOKENS, n
    after, pools_after = replica_counters(c), pool_counters(c)
    served = [r for r in pools_after if pools_after[r][0] > pools[r][0]]
    replica = served[0] if len(served) == 1 else -1
    row: dict[str, object] = {"ttft_ms": ttft * 1000, "replica": replica}
    if replica >= 0:
        row["cached"] = pools_after[replica][1] - pools[replica][1]
        row.update({k: after[replica][k] - before[replica][k]
                    for k in ("hit", "loaded", "fallbacks")})
    return row


@contextmanager
def busy_replica(c: RunningCluster) -> Iterator[int]:
    """A long decode running for the duration: yields the replica it runs on."""
    call = c.stub.Generate(request("Once upon a time", BUSY_TOKENS), timeout=1800)
    started = threading.Event()
    got: list[int] = []

    def drain() -> None:
        try:
            for chunk in call:
                got.append(len(chunk.token_ids))
                started.set()
        except Exception:  # cancelled (expected) or failed: `got` says how far it went
            started.set()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        if not started.wait(120) or not got:
            raise RuntimeError("the long decode did not start")
        busy = [r for r, v in replica_counters(c).items() if v["running"] == 1]
        if len(busy) != 1:
            raise RuntimeError(f"the long decode runs on no single replica: {busy}")
        yield busy[0]
        if sum(got) >= BUSY_TOKENS:
            raise RuntimeError("the long decode ended before (c) did: raise BUSY_TOKENS")
    finally:
        call.cancel()
        thread.join(timeout=30)


def ttft_cluster(store: bool, prompts: list[str], log_dir: Path) -> dict[str, object]:
    """Phases (a), warm, (b), (c) on one fresh 2-replica cluster."""
    workload = workload_module()
    env = {} if store else STORE_OFF_ENV
    worker_args = ["--device", "cpu", "--kv-cache-memory-gib", "1",
                   *([] if store else STORE_OFF_WORKER_ARGS)]
    with run_cluster(log_dir, scheduler_args=["--route-tokens-per-request", ROUTE_WEIGHT],
                     worker_args=worker_args, dtype=DTYPE, num_replicas=2, env=env,
                     ready_timeout_s=300) as c:
        assert wait_for(lambda: sum(r.state == "ready" for r in server_info(c).replicas) == 2,
                        120), "both replicas never became ready"
        # Untimed warm-up of both replicas at once (the second goes to the idle replica).
        run_batch(c.procs.address, list(workload.PROMPTS[:2]), 8)
        assert all(q > 0 for q, _ in pool_counters(c).values()), pool_counters(c)
        out: dict[str, object] = {"store": store}
        out["cold"] = [measure(c, prompts[0])]
        out["warm"] = [measure(c, p) for p in prompts[1:]]
        settle_store(c)
        evicted = []
        for p in prompts:
            evict(c, 0)
            evicted.append(measure(c, p))
            settle_store(c)
        out["evicted"] = evicted
        with busy_replica(c) as busy:
            other = 1 - busy
            second = []
            for p in prompts:
                evict(c, other)
                second.append(measure(c, p))
                settle_store(c)
        out["second_replica"] = second
        out["busy_replica"], out["second_replica_id"] = busy, other
        info = server_info(c)
        out["replicas"] = [{"replica_id": r.replica_id, "dtype": r.dtype,
                            "cpu_level": r.workers[0].cpu_level if r.workers else "",
                            "num_store_miss_tokens": r.num_store_miss_tokens,
                            "num_store_hit_tokens": r.num_store_hit_tokens,
                            "num_store_loaded_tokens": r.num_store_loaded_tokens,
                            "num_store_load_fallbacks": r.num_store_load_fallbacks}
                           for r in info.replicas]
        out["kv_store"] = ({f.name: getattr(info.kv_store, f.name)
                            for f in info.kv_store.DESCRIPTOR.fields if f.name != "tiers"}
                           if info.HasField("kv_store") else None)
        out["log_problems"] = log_problems(log_dir)
    out["anomalies"] = anomalies(out)
    return out


def anomalies(out: dict[str, object]) -> list[str]:
    """What contradicts the set-up: a question served elsewhere than planned, a device-cache
    hit after eviction, no load (or a fallback) with the store, a load without it."""
    found = []
    first = out["cold"][0]["replica"]  # type: ignore[index]
    for key, expected in (("evicted", first), ("second_replica", out["second_replica_id"])):
        for i, row in enumerate(out[key]):  # type: ignore[attr-defined]
            where = f"{key}[{i}]"
            if row["replica"] != expected:
                found.append(f"{where}: served by replica {row['replica']}, not {expected}")
            if row.get("cached"):
                found.append(f"{where}: {row['cached']} tokens found in the replica's blocks")
            if out["store"] and (not row.get("loaded") or row.get("fallbacks")):
                found.append(f"{where}: store on, loaded {row.get('loaded')}, fallbacks "
                             f"{row.get('fallbacks')}")
            if not out["store"] and row.get("loaded"):
                found.append(f"{where}: store off, yet {row['loaded']} tokens loaded")
    return found


def log_problems(log_dir: Path) -> list[str]:
    """Service log lines that look like trouble (errors, tracebacks, fallbacks)."""
    words = ("ERROR", "Traceback", "fallback", "falls back", "CRITICAL")
    return [f"{p.name}: {line.strip()}" for p in sorted(log_dir.glob("*.log"))
            for line in p.read_text(errors="replace").splitlines()
            if any(w in line for w in words)][:40]


# ---------------------------------------------------------------------- part 2: throughput

@contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """`extra` in os.environ (which every service child inherits) for the duration."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def throughput_run(store: bool, prompts: list[str], single: str,
                   max_tokens: int) -> dict[str, float]:
    worker_args = ["--device", "cpu", *([] if store else STORE_OFF_WORKER_ARGS)]
    with environment({} if store else STORE_OFF_ENV):
        return bench_splitserve(prompts, single, max_tokens, DTYPE, [], worker_args)


# ------------------------------------------------------------------------------- reporting

def median_ttft(rows: list[dict[str, object]]) -> float:
    return statistics.median(float(r["ttft_ms"]) for r in rows)  # type: ignore[arg-type]


def evidence(rows: list[dict[str, object]]) -> str:
    return "; ".join(f"r{r['replica']} cached {r.get('cached', '?')} store hit "
                     f"{r.get('hit', '?')} loaded {r.get('loaded', '?')} "
                     f"fallbacks {r.get('fallbacks', '?')}" for r in rows)


def report_ttft(results: dict[str, object]) -> None:
    on, off = results["ttft_store_on"], results["ttft_store_off"]
    assert isinstance(on, dict) and isinstance(off, dict)
    print(f"\nTTFT, document prompts of {results['prompt_tokens']} tokens, "
          f"{results['num_questions']} question(s), median ms (2 replicas, 1 thread each)")
    print(f"{'case':<44}{'store on':>10}{'store off':>11}{'off/on':>8}")
    ratios: dict[str, float] = {}
    for key, label in (("cold", "(a) cold, fresh cluster (1 question)"),
                       ("warm", "    warm, document in replica's blocks"),
                       ("evicted", "(b) after Clear of replica's blocks"),
                       ("second_replica", "(c) second replica (replica 0 busy)")):
        if not on[key]:
            continue
        a, b = median_ttft(on[key]), median_ttft(off[key])
        ratio = b / a
        if key in ("evicted", "second_replica"):
            ratios[key] = ratio
        print(f"{label:<44}{a:>10.0f}{b:>11.0f}{ratio:>7.1f}x")
    results["ttft_ratio_off_on"] = ratios
    ok = all(r >= 5 for r in ratios.values())
    print(f"target >= 5x for (b) and (c): {'met' if ok else 'NOT met'}")
    for name, side in (("store on", on), ("store off", off)):
        for key in ("evicted", "second_replica"):
            print(f"  {name} {key}: {evidence(side[key])}")  # type: ignore[arg-type]
    print(f"  store on, replica {on['second_replica_id']} served (c) while replica "
          f"{on['busy_replica']} decoded; ServerInfo replicas: "
          + ", ".join(f"r{r['replica_id']} loaded {r['num_store_loaded_tokens']} "
                      f"fallbacks {r['num_store_load_fallbacks']}"
                      for r in on["replicas"]))  # type: ignore[union-attr]
    for name, side in (("store on", on), ("store off", off)):
        print(f"  {name} anomalies: {side['anomalies'] or 'none'}")
    print(f"  ServerInfo kv_store (store on): {on['kv_store']}")
    print(f"  ServerInfo kv_store (store off): {off['kv_store']}")
    for name, side in (("store on", on), ("store off", off)):
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
          f"{results['num_prompts']} prompts x {results['max_tokens']} tokens, {DTYPE}, "
          f"median of {results['repeats']} run(s) each, alternating")
    print(f"{'store':<12}{'all at once tok/s':>18}{'runs':>24}")
    for name, side in (("on", tp_on), ("off", tp_off)):
        runs = ", ".join(f"{r['batch_tok_s']:.1f}" for r in side["runs"])
        print(f"{name:<12}{side['batch_tok_s']:>18.1f}{runs:>24}")
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
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
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
    for store in (True, False):
        name = "on" if store else "off"
        start = time.perf_counter()
        side = ttft_cluster(store, texts, log_root / f"store-{name}")
        results[f"ttft_store_{name}"] = side
        print(f"TTFT, store {name}: done in {time.perf_counter() - start:.0f} s "
              f"(logs in {log_root / f'store-{name}'})", flush=True)
    levels = {r["cpu_level"] for r in results["ttft_store_on"]["replicas"]}  # type: ignore[index]
    results["cpu_level"] = sorted(levels)
    print(f"workers' kernel level: {', '.join(sorted(levels))}", flush=True)

    if not a.skip_throughput:
        prompts, single, max_tokens = load_workload()
        prompts = prompts[:16] if a.quick else prompts
        results.update({"num_prompts": len(prompts), "max_tokens": max_tokens,
                        "repeats": a.repeats})
        runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for i in range(a.repeats):
            for store in ((True, False) if i % 2 == 0 else (False, True)):
                start = time.perf_counter()
                runs[store].append(throughput_run(store, prompts, single, max_tokens))
                print(f"throughput run {i + 1}/{a.repeats} store {'on' if store else 'off'}: "
                      f"{runs[store][-1]['batch_tok_s']:.1f} tok/s "
                      f"({time.perf_counter() - start:.0f} s with start-up)", flush=True)
        results["throughput_store_on"] = medians(runs[True])
        results["throughput_store_off"] = medians(runs[False])
    report_ttft(results)
    if not a.skip_throughput:
        report_throughput(results)
    write_result(results, a.out, "kv_store")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
