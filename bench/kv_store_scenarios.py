"""bench/kv_store.py's further scenarios (issue 24, point 7), each on fresh one-replica
clusters: the seeds' 32-token prompt, a chat of 10 turns that re-sends its growing history,
and a hit served by the disk tier. Results come back as plain dicts; bench/kv_store.py runs
them and reports.

- seeds: a 32-token prompt (token ids) with --max-num-batched-tokens 24, so its prefill runs
  in chunks of 24 and 8; the workers' log lines of what they stored; then, after an admin
  Clear of the replica's blocks, the same prompt again (store on: 31 tokens loaded, one
  computed). Store on and off.
- chat: turn k sends the system message, k user messages (a few of the shared workload's
  sentences each) and the k - 1 answers the model gave (24 greedy tokens each, through the
  chat API). Three clusters: the store on with the replica's blocks cleared before every turn
  (another tenant's traffic evicted the history: it comes back from the store); the store off,
  cleared alike (every turn recomputes its history); the store off, never cleared (prefix
  caching alone, the history still in the replica's blocks: the bound). The answers of the
  three must agree token for token (greedy, float32).
- disk: the store's memory tier smaller than one chunk (SPLITSERVE_KV_STORE_MEMORY_GIB), so
  the document's chunks live in the disk tier (--kv-store-dir under the logs) and every hit is
  read from there (the page cache warm: the files were just written); (b) as in
  bench/kv_store.py, the replica's blocks cleared before each question.
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kv_store_runs import (  # noqa: E402
    DTYPE,
    STORE_OFF_ENV,
    STORE_OFF_WORKER_ARGS,
    evict,
    measure,
    measure_evicted,
    settle_store,
    workload_module,
)

from services.rpc.splitserve.v1 import generation_pb2  # noqa: E402
from tests.e2e.harness import RunningCluster, run_cluster  # noqa: E402

CHAT_TURNS = 10
CHAT_ANSWER_TOKENS = 24
SENTENCES_PER_TURN = 8
SEEDS_TOKENS = 32
SEEDS_BUDGET = 24             # --max-num-batched-tokens: the seeds' chunks of 24 and 8
DISK_MEMORY_GIB = "0.001"     # the memory tier holds no chunk: hits come from disk


def cluster(store: bool, log_dir: Path, scheduler_args: list[str] | None = None,
            env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """A one-replica cluster on the default model, float32, the store on or off."""
    worker_args = ["--device", "cpu", "--kv-cache-memory-gib", "1",
                   *([] if store else STORE_OFF_WORKER_ARGS)]
    return run_cluster(log_dir, scheduler_args=scheduler_args or [], worker_args=worker_args,
                       dtype=DTYPE, num_replicas=1,
                       env={**(env or {}), **({} if store else STORE_OFF_ENV)},
                       ready_timeout_s=300)


def stream(c: RunningCluster, req: generation_pb2.GenerateRequest
           ) -> tuple[float, list[int], str, generation_pb2.Usage]:
    """Seconds to the first token, the tokens, their text and the final usage."""
    start = time.perf_counter()
    first, tokens, text, usage = 0.0, [], "", generation_pb2.Usage()
    for chunk in c.stub.Generate(req, timeout=600):
        if chunk.token_ids and not first:
            first = time.perf_counter() - start
        tokens += chunk.token_ids
        text += chunk.text
        if chunk.HasField("usage"):
            usage = chunk.usage
    return first, tokens, text, usage


def greedy(max_tokens: int) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=True)


def usage_row(ttft_s: float, usage: generation_pb2.Usage) -> dict[str, object]:
    return {"ttft_ms": ttft_s * 1000, "prompt_tokens": usage.prompt_tokens,
            "cached": usage.cached_prompt_tokens, "store_hit": usage.store_hit_tokens}


# ------------------------------------------------------------------------------------ seeds

def seeds_run(store: bool, token_ids: list[int], log_dir: Path) -> dict[str, object]:
    """The seeds' prompt cold, then after a Clear of the replica's blocks."""
    with cluster(store, log_dir, ["--max-num-batched-tokens", str(SEEDS_BUDGET)]) as c:
        req = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=token_ids), sampling=greedy(4))
        cold_s, cold, _, cold_usage = stream(c, req)
        settle_store(c)
        evict(c, 0)
        again_s, again, _, again_usage = stream(c, req)
        logs = "\n".join(p.read_text() for p in sorted(log_dir.glob("worker*")))
    return {"store": store, "cold": usage_row(cold_s, cold_usage),
            "evicted": usage_row(again_s, again_usage), "same_tokens": cold == again,
            "stored_lines": [line.split("kv_saver: ")[-1] for line in logs.splitlines()
                             if "stored KV for" in line]}


# ------------------------------------------------------------------------------------- chat

def chat_user_turns() -> list[str]:
    sentences = workload_module().SENTENCES
    turns = []
    for k in range(CHAT_TURNS):
        picked = [sentences[(k * SENTENCES_PER_TURN + i) % len(sentences)]
                  for i in range(SENTENCES_PER_TURN)]
        turns.append("Here are more notes:\n" + "\n".join(picked)
                     + "\nWhich of these notes is the most surprising, and why?")
    return turns


def chat_run(mode: str, log_dir: Path) -> dict[str, object]:
    """mode "store": store on, blocks cleared before every turn; "none": store off, cleared
    alike; "prefix": store off, never cleared (prefix caching alone)."""
    users = chat_user_turns()
    answers: list[str] = []
    rows: list[dict[str, object]] = []
    with cluster(mode == "store", log_dir) as c:
        stream(c, generation_pb2.GenerateRequest(text="Hello", sampling=greedy(2)))  # warm-up
        for k in range(CHAT_TURNS):
            messages = [generation_pb2.ChatMessage(role="system",
                                                   content="You are a helpful assistant.")]
            for i in range(k + 1):
                messages.append(generation_pb2.ChatMessage(role="user", content=users[i]))
                if i < k:
                    messages.append(generation_pb2.ChatMessage(role="assistant",
                                                               content=answers[i]))
            if mode != "prefix":
                settle_store(c)
                evict(c, 0)
            ttft_s, _, text, usage = stream(c, generation_pb2.GenerateRequest(
                chat=generation_pb2.ChatMessages(messages=messages),
                sampling=greedy(CHAT_ANSWER_TOKENS)))
            answers.append(text)
            rows.append({"turn": k + 1, **usage_row(ttft_s, usage)})
    return {"mode": mode, "turns": rows, "answers": answers}


# ------------------------------------------------------------------------------------- disk

def disk_run(prompts: list[str], log_dir: Path) -> dict[str, object]:
    """(b) with every hit read from the disk tier, once every question was asked (as in
    bench/kv_store.py, whose warm rows do that)."""
    env = {"SPLITSERVE_KV_STORE_DIR": str(log_dir / "store"),
           "SPLITSERVE_KV_STORE_MEMORY_GIB": DISK_MEMORY_GIB}
    with cluster(True, log_dir / "logs", env=env) as c:
        stream(c, generation_pb2.GenerateRequest(text="Hello", sampling=greedy(2)))  # warm-up
        cold = measure(c, prompts[0])
        for p in prompts[1:]:       # untimed: every question's own tail is stored too
            measure(c, p)
        settle_store(c)
        evicted = measure_evicted(c, prompts)
        store = c.kv_stats().store
        tiers = {t.name: (t.num_chunks, t.num_bytes) for t in store.tiers}
    return {"cold": cold, "evicted": evicted, "tiers": tiers,
            "num_loaded_chunks": store.num_loaded_chunks}


# -------------------------------------------------------------------------- run and report

def run_scenarios(prompts: list[str], seeds_ids: list[int], log_root: Path
                  ) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, run in (("seeds_on", lambda d: seeds_run(True, seeds_ids, d)),
                      ("seeds_off", lambda d: seeds_run(False, seeds_ids, d)),
                      ("chat_store", lambda d: chat_run("store", d)),
                      ("chat_none", lambda d: chat_run("none", d)),
                      ("chat_prefix", lambda d: chat_run("prefix", d)),
                      ("disk", lambda d: disk_run(prompts, d))):
        start = time.perf_counter()
        out[name] = run(log_root / name)
        print(f"{name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def report_scenarios(s: dict[str, object], evicted_memory_ms: float, evicted_off_ms: float
                     ) -> dict[str, float]:
    """Prints the scenarios' tables; returns their headline ratios."""
    ratios: dict[str, float] = {}
    on, off = s["seeds_on"], s["seeds_off"]
    assert isinstance(on, dict) and isinstance(off, dict)
    print(f"\nseeds' scenario: a {SEEDS_TOKENS}-token prompt, --max-num-batched-tokens "
          f"{SEEDS_BUDGET}, then again after a Clear of the replica's blocks")
    for name, side in (("store on", on), ("store off", off)):
        cold, ev = side["cold"], side["evicted"]
        print(f"  {name:<10} cold {cold['ttft_ms']:.0f} ms; again {ev['ttft_ms']:.0f} ms, "
              f"cached {ev['cached']} of {ev['prompt_tokens']} (store {ev['store_hit']}); "
              f"same tokens: {side['same_tokens']}")
    for line in on["stored_lines"]:  # type: ignore[union-attr]
        print(f"  worker: {line}")

    chats = {m: s[f"chat_{m}"] for m in ("store", "none", "prefix")}
    print(f"\nchat of {CHAT_TURNS} turns re-sending the history ({CHAT_ANSWER_TOKENS} answer "
          f"tokens each): TTFT ms per turn; store and none: the replica's blocks cleared "
          f"before every turn; prefix: store off, never cleared")
    print(f"{'turn':>5}{'prompt':>8}{'store':>8}{'(cached/store)':>16}{'none':>8}"
          f"{'prefix':>8}{'(cached)':>10}")
    turns = [c["turns"] for c in chats.values()]  # type: ignore[index]
    for st, no, pr in zip(*turns, strict=True):
        print(f"{st['turn']:>5}{st['prompt_tokens']:>8}{st['ttft_ms']:>8.0f}"
              f"{str(st['cached']) + '/' + str(st['store_hit']):>16}{no['ttft_ms']:>8.0f}"
              f"{pr['ttft_ms']:>8.0f}{pr['cached']:>10}")
    later = slice(1, None)          # turn 1 has no history to reuse
    sums = {m: sum(r["ttft_ms"] for r in t[later]) for m, t in zip(chats, turns, strict=True)}
    ratios["chat_none_over_store"] = sums["none"] / sums["store"]
    ratios["chat_store_over_prefix"] = sums["store"] / sums["prefix"]
    agree = len({tuple(c["answers"]) for c in chats.values()}) == 1  # type: ignore[index]
    print(f"turns 2-{CHAT_TURNS}, TTFT summed: store {sums['store']:.0f} ms, none "
          f"{sums['none']:.0f} ms ({ratios['chat_none_over_store']:.1f}x the store's), "
          f"prefix caching alone {sums['prefix']:.0f} ms (the store's "
          f"{ratios['chat_store_over_prefix']:.2f}x it); answers equal in all three: {agree}")

    disk = s["disk"]
    assert isinstance(disk, dict)
    disk_ms = _median([r["ttft_ms"] for r in disk["evicted"]])  # type: ignore[index]
    ratios["disk_off_over_on"] = evicted_off_ms / disk_ms
    print(f"\ndisk tier: (b) with every hit read from disk (memory tier {DISK_MEMORY_GIB} GiB, "
          f"page cache warm): {disk_ms:.0f} ms median, against {evicted_memory_ms:.0f} ms from "
          f"memory and {evicted_off_ms:.0f} ms with the store off "
          f"({ratios['disk_off_over_on']:.1f}x); tiers (chunks, bytes) {disk['tiers']}; "
          f"loaded chunks {disk['num_loaded_chunks']}; rows: "
          + "; ".join(f"loaded {r.get('loaded', '?')} fallbacks {r.get('fallbacks', '?')}"
                      for r in disk["evicted"]))  # type: ignore[union-attr]
    return ratios
