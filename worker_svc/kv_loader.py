"""`KvLoader`: fetches KV chunks from kvcache_svc's KV store into a request's blocks (issue 15,
loading).

A step may carry requests with `NewRequest.num_load_tokens`: kvcache_svc found those tokens
(past the request's prefix hit) in the store for every rank. Such a request computes nothing
in that step; instead `start` keys its chunks on the step's thread (the same chained hashes
and cache salt the saver uses, `kv_saver.extend_block_hashes`) and the loader's thread fetches
them while the step's forward runs the other requests. Each chunk in the leading run that
arrived intact (the client checks key, sizes and checksum) is copied into the request's own
blocks past its prefix hit; a chunk that is gone, damaged or late ends the run there. The
ticket's `wait` gives, per request, how many of its load tokens are now in the cache: the
worker reports that in a `KvLoaded`, and the scheduler recomputes from the smallest count
any rank reported. Nothing here raises into the step: a failure is a short count.

Loads run in the background across steps: the worker sends a step's output without waiting
for them, and each rank sends its `KvLoaded` once the ticket completes (worker_svc.server).
The scheduler holds the request meanwhile, so only a step that names it in `finished_ids`
(aborted, or every request preempted) can come first, and the blocks it frees may be handed
out by that very step: `wait_for` holds such a step until the loads naming those requests are
done. On a GPU the copies go through a stream of the loader's own, synchronized before the
ticket completes, so the step that computes after the load finds the KV in place.
"""

import logging
import queue
import threading
import warnings
from dataclasses import dataclass

import torch
import zmq

from services.codec import Codec
from services.kv_chunks import KvChunk, chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey, FromKvStore
from services.kv_tensors import TORCH_DTYPES
from services.wire import KvLoaded, StepInput
from worker_svc.input_batch import InputBatch, RequestState
from worker_svc.kv_saver import KvSaver, extend_block_hashes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Job:
    request_id: str
    keys: list[ChunkKey]        # chunks first_chunk, first_chunk + 1, ... up to the load's end
    first_chunk: int            # chunk i covers tokens [i * chunk_tokens, (i + 1) * ...)
    start: int                  # first token to write (the prefix hit's end: whole blocks)
    end: int                    # one past the last token to load
    block_ids: list[int]        # the request's blocks


class LoadTicket:
    """One step's loads; `wait` returns request id -> tokens loaded (after `start`)."""

    def __init__(self, step_id: int, request_ids: list[str]) -> None:
        self.step_id = step_id
        self.request_ids = request_ids
        self.loaded: dict[str, int] = dict.fromkeys(request_ids, 0)
        self._done = threading.Event()

    def complete(self) -> None:
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def report(self, worker_id: str) -> KvLoaded:
        """This rank's KvLoaded for the step (call once `done`)."""
        return KvLoaded(worker_id=worker_id, step_id=self.step_id,
                        request_ids=list(self.loaded),
                        num_loaded_tokens=list(self.loaded.values()))

    def wait(self) -> dict[str, int]:
        self._done.wait()
        return self.loaded


class KvLoader:
    def __init__(self, saver: KvSaver, codec: Codec[FromKvStore] | None = None) -> None:
        """Loads through the store `saver` saves to, in its chunk size and slice."""
        self.saver = saver
        self.num_chunks_loaded = 0
        self.num_tokens_loaded = 0
        self.num_loads_short = 0            # requests that got fewer tokens than asked
        self._pending: list[LoadTicket] = []  # started, oldest first (the step's thread's)
        self._jobs: queue.SimpleQueue[tuple[LoadTicket, list[_Job], list[torch.Tensor]] | None] \
            = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, args=(codec,), name="kv-loader",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # ----------------------------------------------------------------------- the step's thread

    def start(self, step: StepInput, requests: dict[str, RequestState],
              kv_caches: list[torch.Tensor], block_size: int) -> LoadTicket | None:
        """Starts the step's loads (None when it has none)."""
        loads = [r for r in step.new_requests if r.num_load_tokens and r.request_id in requests]
        if not loads:
            return None
        ticket = LoadTicket(step.step_id, [r.request_id for r in loads])
        self._pending = [t for t in self._pending if not t.done] + [ticket]
        chunk_tokens = self.saver.chunk_tokens
        if (chunk_tokens is None or chunk_tokens % block_size or not kv_caches
                or not self._thread.is_alive()):
            ticket.complete()     # no store known (or no loader): every load falls back
            return ticket
        jobs = []
        for request in loads:
            state = requests[request.request_id]
            start = request.num_computed_tokens
            end = start + request.num_load_tokens
            first_chunk, end_chunk = start // chunk_tokens, -(-end // chunk_tokens)
            num_hashed = min(end_chunk * chunk_tokens,
                             len(state.token_ids) // block_size * block_size)
            if not extend_block_hashes(state, num_hashed, block_size):
                continue
            keys = chunk_keys(state.block_hashes[:num_hashed // block_size], block_size,
                              chunk_tokens, self.saver.kv_slice)[first_chunk:]
            jobs.append(_Job(request.request_id, keys, first_chunk, start, end,
                             list(state.block_ids)))
        self._jobs.put((ticket, jobs, kv_caches))
        return ticket

    def wait_for(self, request_ids: list[str]) -> None:
        """Waits until no load still writes the blocks of `request_ids` (a step finishing
        them may hand their blocks to another request). Loads run in start order."""
        if not request_ids or not self._pending:
            return
        ids = set(request_ids)
        last = max((i for i, t in enumerate(self._pending) if ids & set(t.request_ids)),
                   default=-1)
        if last >= 0:
            self._pending[last].wait()

    # ---------------------------------------------------------------------- the loader's thread

    def _run(self, codec: Codec[FromKvStore] | None) -> None:
        client = KvStoreClient(self._ctx, self.saver.address, codec=codec)
        stream: torch.cuda.Stream | None = None
        try:
            while (work := self._jobs.get()) is not None:
                ticket, jobs, kv_caches = work
                if stream is None and kv_caches[0].device.type == "cuda":
                    stream = torch.cuda.Stream(device=kv_caches[0].device)
                try:
                    for job in jobs:
                        ticket.loaded[job.request_id] = self._load(client, job, kv_caches,
                                                                   stream)
                except Exception:   # a bug: the rest fall back to recompute, the step goes on
                    log.exception("KV load failed")
                finally:
                    if stream is not None:
                        stream.synchronize()
                    self.num_loads_short += sum(
                        1 for job in jobs if ticket.loaded[job.request_id] < job.end - job.start)
                    ticket.complete()
        finally:
            client.close()
            self._ctx.term()

    def _load(self, client: KvStoreClient, job: _Job, kv_caches: list[torch.Tensor],
              stream: torch.cuda.Stream | None) -> int:
        """Tokens of the job now in its blocks: the leading run of chunks that arrived."""
        chunk_tokens = self.saver.chunk_tokens
        assert chunk_tokens is not None
        cache = kv_caches[0]                 # [2, num_blocks, block_size, heads, head_dim]
        block_size = cache.shape[2]
        shape = (len(kv_caches), 2, chunk_tokens, *cache.shape[3:])
        loaded_end = job.start
        for offset, chunk in enumerate(client.load(job.keys)):
            if chunk is None or tuple(chunk.header.shape) != shape or (
                    TORCH_DTYPES[chunk.key.dtype] != cache.dtype):
                break
            index = job.first_chunk + offset
            first_block = max(index * chunk_tokens, job.start) // block_size
            end_block = min((index + 1) * chunk_tokens // block_size, len(job.block_ids))
            scatter_blocks(kv_caches, chunk, job.block_ids[first_block:end_block],
                           first_block - index * chunk_tokens // block_size, stream)
            self.num_chunks_loaded += 1
            loaded_end = (index + 1) * chunk_tokens
        num_loaded = max(0, min(loaded_end, job.end) - job.start)
        self.num_tokens_loaded += num_loaded
        return num_loaded


def scatter_blocks(kv_caches: list[torch.Tensor], chunk: KvChunk, block_ids: list[int],
                   first: int, stream: torch.cuda.Stream | None) -> None:
    """Copies the chunk's blocks `first`, `first + 1`, ... into `block_ids` of every layer.
    The chunk's layout is the saver's: [layers, 2, chunk_tokens, heads, head_dim]."""
    if not block_ids:
        return
    cache = kv_caches[0]
    with warnings.catch_warnings():      # a received frame is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(chunk.data, dtype=cache.dtype)
    blocks = flat.view(len(kv_caches), 2, -1, *cache.shape[2:])[:, :, first:first + len(block_ids)]
    index = torch.tensor(block_ids, dtype=torch.int64)
    if cache.device.type == "cpu":
        for layer, layer_cache in enumerate(kv_caches):
            layer_cache.index_copy_(1, index, blocks[layer])
        return
    assert stream is not None
    with torch.cuda.stream(stream):
        on_device = blocks.to(cache.device)
        index = index.to(cache.device)
        for layer, layer_cache in enumerate(kv_caches):
            layer_cache.index_copy_(1, index, on_device[layer])


def start_loads(loader: KvLoader | None, step: StepInput, input_batch: InputBatch,
                kv_caches: list[torch.Tensor]) -> LoadTicket | None:
    """The step's loads started (None when it has none); without a loader (no store) a
    completed ticket that loaded nothing, so every rank still reports and the scheduler
    recomputes."""
    if loader is not None:
        return loader.start(step, input_batch.requests, kv_caches, input_batch.block_size)
    ids = [r.request_id for r in step.new_requests if r.num_load_tokens]
    if not ids:
        return None
    ticket = LoadTicket(step.step_id, ids)
    ticket.complete()
    return ticket
