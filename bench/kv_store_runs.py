"""The cluster side of bench/kv_store.py: starting its clusters (store on and off), running the
TTFT phases (a) cold/warm, (b) evicted and (c) second replica on one of them, reading the
evidence of where each question went and what the store did (ServerInfo, kvcache_svc's pool and
store counters, the service logs), and one throughput run of the shared workload. Results come
back as plain dicts; bench/kv_store.py (the CLI) builds the prompts, calls ttft_cluster and
throughput_run, and reports. See its docstring for the phases and targets."""

import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import zmq  # noqa: E402
from bench_io import load_workload  # noqa: E402
from splitserve_runs import bench_splitserve, request, run_batch, run_stream  # noqa: E402

from services.block_hash import BLOCK_HASH_BYTES  # noqa: E402
from services.channels import tcp_address  # noqa: E402
from services.cluster_token import frame_key  # noqa: E402
from services.codec import Codec  # noqa: E402
from services.kv_chunks import make_chunk  # noqa: E402
from services.kv_store_client import KvStoreClient  # noqa: E402
from services.kv_store_wire import MAX_STORE_HEADER_BYTES, ChunkKey, FromKvStore  # noqa: E402
from services.launcher import INTERNAL_HOST  # noqa: E402
from services.model_config import default_model_path, load_model_config  # noqa: E402
from services.rpc.splitserve.v1 import generation_pb2, kvcache_pb2  # noqa: E402
from tests.e2e.harness import RunningCluster, run_cluster, wait_for  # noqa: E402
from worker_svc.kv_fetcher import ChunkFetcher  # noqa: E402

DTYPE = "float32"
ANSWER_TOKENS = 4             # TTFT is the point; a few tokens prove the stream goes on
BUSY_TOKENS = 4000            # replica 0's long decode in (c), cancelled when (c) is done
ROUTE_WEIGHT = "100000"       # --route-tokens-per-request: one live request outweighs any hit
# Store off: kvcache_svc runs none (its --no-kv-store, by environment: the harness passes
# kvcache_svc no extra flag) and the workers save nowhere (a later --kv-store wins).
STORE_OFF_ENV = {"SPLITSERVE_KV_NO_STORE": "1"}
STORE_OFF_WORKER_ARGS = ("--kv-store", "")


def workload_module():  # type: ignore[no-untyped-def]
    """shared/bench/workload.py as a module (load_workload puts its folder on sys.path)."""
    load_workload()
    import workload  # type: ignore[import-not-found]

    return workload


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


def measure_evicted(c: RunningCluster, prompts: list[str]) -> list[dict[str, object]]:
    """(b): each question after an admin Clear of replica 0's blocks (saves settled after)."""
    rows = []
    for p in prompts:
        evict(c, 0)
        rows.append(measure(c, p))
        settle_store(c)
    return rows


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


def ttft_cluster(store: bool, prompts: list[str], log_dir: Path, layerwise: bool = True,
                 ) -> dict[str, object]:
    """Phases (a), warm, (b), (c) on one fresh 2-replica cluster. `layerwise` False: a hit
    loads whole before the rest of its prompt is computed (--no-layerwise-kv-loads)."""
    workload = workload_module()
    env = {} if store else STORE_OFF_ENV
    worker_args = ["--device", "cpu", "--kv-cache-memory-gib", "1",
                   *([] if store else STORE_OFF_WORKER_ARGS)]
    scheduler_args = ["--route-tokens-per-request", ROUTE_WEIGHT,
                      *([] if layerwise else ["--no-layerwise-kv-loads"])]
    with run_cluster(log_dir, scheduler_args=scheduler_args,
                     worker_args=worker_args, dtype=DTYPE, num_replicas=2, env=env,
                     ready_timeout_s=300) as c:
        assert wait_for(lambda: sum(r.state == "ready" for r in server_info(c).replicas) == 2,
                        120), "both replicas never became ready"
        # Untimed warm-up of both replicas at once (the second goes to the idle replica).
        run_batch(c.procs.address, list(workload.PROMPTS[:2]), 8)
        assert all(q > 0 for q, _ in pool_counters(c).values()), pool_counters(c)
        out: dict[str, object] = {"store": store, "layerwise": layerwise}
        out["cold"] = [measure(c, prompts[0])]
        out["warm"] = [measure(c, p) for p in prompts[1:]]
        settle_store(c)
        out["evicted"] = evicted = measure_evicted(c, prompts)
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
        if store:
            hit = int(statistics.median(row.get("loaded", 0) for row in evicted))  # type: ignore[misc]
            out["transfer"] = store_transfer(c, hit)
        out["log_problems"] = log_problems(log_dir)
    out["anomalies"] = anomalies(out)
    return out


def store_transfer(c: RunningCluster, num_tokens: int, repeats: int = 3) -> dict[str, float]:
    """What (b)'s TTFT is compared with: the same bytes (`num_tokens` of this model's float32
    KV, in chunks of the store's size) fetched from the cluster's store by the worker's own
    fetcher (one chunk per message, a few ahead, each checked), without the copy into blocks.
    Random data under a model name no worker uses; median ms of `repeats` after two untimed."""
    config = load_model_config(default_model_path())
    chunk_tokens = c.kv_stats().store.chunk_tokens or 256
    shape = (config.num_layers, 2, chunk_tokens, config.num_kv_heads, config.head_dim)
    sizes = [chunk_tokens] * (num_tokens // chunk_tokens)
    sizes += [num_tokens % chunk_tokens] if num_tokens % chunk_tokens else []
    codec = Codec(FromKvStore, max_frame_bytes=MAX_STORE_HEADER_BYTES,
                  key=frame_key(c.procs.cluster_token))
    address = tcp_address(INTERNAL_HOST, c.procs.spec.kv_store_port)
    keys, chunks = [], []
    for i, n in enumerate(sizes):
        key = ChunkKey(block_hash=(i + 1).to_bytes(BLOCK_HASH_BYTES, "little"),
                       num_tokens=n, model="bench-transfer@0", dtype="float32", layer_start=0,
                       layer_end=shape[0], head_start=0, head_end=shape[3])
        data = torch.randn(shape[0], 2, n, *shape[3:]).numpy().tobytes()
        keys.append(key)
        chunks.append(make_chunk(key, (shape[0], 2, n, *shape[3:]), data))
    ctx = zmq.Context()
    saver = KvStoreClient(ctx, address, codec=codec)
    fetcher = ChunkFetcher(lambda ctx: KvStoreClient(ctx, address, codec=codec))
    try:
        stored = saver.save(chunks)
        if stored.num_failed_chunks:
            raise RuntimeError(f"the store kept {stored} of {len(chunks)} reference chunks")
        times = []
        # Two untimed rounds first: the first large receives of a process take fresh pages
        # (glibc serves them by mmap until a free raises its threshold), 2-3x slower here.
        for round_ in range(2 + repeats):
            start = time.perf_counter()
            got = list(fetcher.fetch(keys))
            if round_ >= 2:
                times.append((time.perf_counter() - start) * 1000)
            if len(got) != len(keys) or any(chunk is None for chunk in got):
                raise RuntimeError("a reference chunk did not come back")
    finally:
        fetcher.close()
        saver.close()
        ctx.term()
    return {"num_tokens": num_tokens, "num_bytes": sum(chunk.num_bytes for chunk in chunks),
            "num_chunks": len(chunks), "fetch_ms": statistics.median(times)}


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


def throughput_run(store: bool, prompts: list[str], single: str, max_tokens: int,
                   dtype: str = DTYPE) -> dict[str, float]:
    worker_args = ["--device", "cpu", *([] if store else STORE_OFF_WORKER_ARGS)]
    with environment({} if store else STORE_OFF_ENV):
        return bench_splitserve(prompts, single, max_tokens, dtype, [], worker_args)
