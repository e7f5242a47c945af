"""`KvLoader`: fetches KV chunks from kvcache_svc's KV store into a request's blocks (issue 15,
loading).

A step may carry requests with `NewRequest.num_load_tokens`: kvcache_svc found those tokens
(past the request's prefix hit) in the store for every rank. Such a request computes nothing
in that step; instead `start` keys its chunks on the step's thread (the same chained hashes
and cache salt the saver uses, `kv_saver.extend_block_hashes`) and the loader's thread fetches
them while the step's forward runs the other requests, a chunk per message a few chunks
ahead (worker_svc.kv_fetcher), so copying one into the cache overlaps the next one's
transfer. Each chunk in the leading run that arrived intact (the client checks key, sizes and
checksum) is copied into the request's own blocks past its prefix hit; a chunk that is gone,
damaged or late ends the run there. The ticket's `wait` gives, per request, how many of its
load tokens are now in the cache: the worker reports that in a `KvLoaded`, and the scheduler
recomputes from the smallest count any rank reported. Nothing here raises into the step: a
failure is a short count.

Loads run in the background across steps: the worker sends a step's output without waiting
for them, and each rank sends its `KvLoaded` once the ticket completes (worker_svc.step_loop).
The scheduler holds the request meanwhile, so only a step that names it in `finished_ids`
(aborted, or every request preempted) can come first, and the blocks it frees may be handed
out by that very step: `wait_for` holds such a step until the loads naming those requests are
done.

On a GPU the copies go through a stream of the loader's own, ordered against the compute
stream by CUDA events both ways (`StreamOrder`): the loader's stream waits for everything
queued on the compute stream when the load started (a step still in flight may touch blocks
freed before it and handed to the loading request), and the compute stream waits for the
loader's last copy before the next step that can read the blocks (`join_loads`, called at
every launch). The host also synchronizes the loader's stream before the ticket completes,
so a KvLoaded is sent only once the KV is in place.
"""

import logging
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from services.codec import Codec
from services.kv_chunks import KvChunk, prefix_chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey, FromKvStore
from services.kv_tensors import TORCH_DTYPES
from services.wire import KvLoaded, StepInput
from worker_svc.input_batch import InputBatch, RequestState
from worker_svc.kv_fetcher import ChunkFetcher
from worker_svc.kv_saver import KvSaver, extend_block_hashes, token_slots

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Job:
    request_id: str
    keys: list[ChunkKey]        # chunks first_chunk, first_chunk + 1, ...: the last may be partial
    first_chunk: int            # window i covers tokens [i * chunk_tokens, (i + 1) * ...)
    start: int                  # first token to write (the prefix hit's end: whole blocks)
    end: int                    # one past the last token to load
    block_ids: list[list[int]]  # the request's blocks, per KV group


class LoadTicket:
    """One step's loads; `wait` returns request id -> tokens loaded (after `start`)."""

    def __init__(self, step_id: int, request_ids: list[str]) -> None:
        self.step_id = step_id
        self.request_ids = request_ids
        self.loaded: dict[str, int] = dict.fromkeys(request_ids, 0)
        self.ready: object | None = None    # compute-stream event recorded at start (GPU)
        self.copied: object | None = None   # loader-stream event after the last copy (GPU)
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


class StreamOrder:
    """CUDA events between the compute stream (the step's thread) and the loader's own stream
    (its thread), so that a load never races a step on the GPU: `mark_ready` and `join` run on
    the step's thread, `copying` and `mark_copied` on the loader's. Tests give a recording
    twin with the same methods."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None     # made on the loader's thread

    def mark_ready(self) -> torch.cuda.Event:
        """An event after all the work queued so far on the compute stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def copying(self, ready: object) -> Iterator[None]:
        """Copies inside run on the loader's stream, after `ready` (mark_ready's event)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        self.stream.wait_event(ready)            # type: ignore[arg-type]
        with torch.cuda.stream(self.stream):
            yield

    def mark_copied(self) -> torch.cuda.Event:
        """An event after the loader's copies, waited for on the host too."""
        event = torch.cuda.Event()
        if self.stream is not None:
            event.record(self.stream)
            event.synchronize()
        return event

    def join(self, copied: object) -> None:
        """The compute stream waits for the loader's copies before anything queued later."""
        torch.cuda.current_stream(self.device).wait_event(copied)  # type: ignore[arg-type]


class KvLoader:
    def __init__(self, saver: KvSaver, codec: Codec[FromKvStore] | None = None,
                 order: StreamOrder | None = None) -> None:
        """Loads through the store `saver` saves to, in its chunk size and slice. `order`:
        the stream ordering to use whatever the cache's device (tests); by default one for
        a CUDA cache, none for a CPU one."""
        self.saver = saver
        self._order = order
        self._unjoined: list[LoadTicket] = []   # completed loads the compute stream must join
        self.num_chunks_loaded = 0
        self.num_tokens_loaded = 0
        self.num_loads_short = 0            # requests that got fewer tokens than asked
        self._pending: list[LoadTicket] = []  # started, oldest first (the step's thread's)
        self._jobs: queue.SimpleQueue[
            tuple[LoadTicket, list[_Job], list[torch.Tensor], list[int]] | None] \
            = queue.SimpleQueue()
        # Chunks come a few ahead, on the fetcher's thread: the loader's copies of one chunk
        # overlap the next one's transfer (worker_svc.kv_fetcher).
        self._fetcher = ChunkFetcher(
            lambda ctx: KvStoreClient(ctx, saver.address, codec=codec))
        self._thread = threading.Thread(target=self._run, name="kv-loader", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self._fetcher.close(timeout_s)

    # ----------------------------------------------------------------------- the step's thread

    def start(self, step: StepInput, requests: dict[str, RequestState],
              kv_caches: list[torch.Tensor], block_size: int,
              layer_groups: Sequence[int] | None = None) -> LoadTicket | None:
        """Starts the step's loads (None when it has none). `kv_caches`: one per layer;
        `layer_groups`: each layer's KV group (None: all 0)."""
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
        order = self._order_for(kv_caches[0].device)
        if order is not None:
            # After every step queued so far: those may still read or write these blocks.
            ticket.ready = order.mark_ready()
            self._unjoined.append(ticket)
        jobs = []
        for request in loads:
            state = requests[request.request_id]
            start = request.num_computed_tokens
            end = start + request.num_load_tokens
            # kvcache_svc loads whole chunks, or all but the last token of a request whose
            # chunks the store holds to its end (the last one partial, or full).
            chunks_end = end if end % chunk_tokens == 0 else end + 1
            tokens = state.token_ids[:chunks_end]
            if (len(tokens) < chunks_end or min(tokens) < 0 or not extend_block_hashes(
                    state, chunks_end // block_size * block_size, block_size)):
                continue
            keys = prefix_chunk_keys(state.block_hashes, state.token_ids, start, chunks_end,
                                     block_size, chunk_tokens, self.saver.kv_slice,
                                     state.cache_salt)
            jobs.append(_Job(request.request_id, keys, start // chunk_tokens, start, end,
                             [list(ids) for ids in state.block_ids]))
        groups = list(layer_groups) if layer_groups is not None else [0] * len(kv_caches)
        self._jobs.put((ticket, jobs, kv_caches, groups))
        return ticket

    def join_loads(self) -> None:
        """Makes the compute stream wait for every completed load's copies; call before a
        step's forward (a load's blocks are read only by steps launched after it
        completed). A load still running is joined by a later call."""
        if not self._unjoined:
            return
        still: list[LoadTicket] = []
        for ticket in self._unjoined:
            if not ticket.done:
                still.append(ticket)
            elif ticket.copied is not None and self._order is not None:
                self._order.join(ticket.copied)
        self._unjoined = still

    def _order_for(self, device: torch.device) -> StreamOrder | None:
        if self._order is None and device.type == "cuda":
            self._order = StreamOrder(device)
        return self._order

    def wait_all(self) -> None:
        """Waits until no load writes any block (the cache is about to be freed)."""
        for ticket in self._pending:
            ticket.wait()
        self._pending, self._unjoined = [], []

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

    def _run(self) -> None:
        while (work := self._jobs.get()) is not None:
            ticket, jobs, kv_caches, layer_groups = work
            order = self._order if ticket.ready is not None else None
            try:
                with order.copying(ticket.ready) if order is not None else nullcontext():
                    for job in jobs:
                        ticket.loaded[job.request_id] = self._load(job, kv_caches,
                                                                   layer_groups)
            except Exception:   # a bug: the rest fall back to recompute, the step goes on
                log.exception("KV load failed")
            finally:
                if order is not None:
                    ticket.copied = order.mark_copied()
                self.num_loads_short += sum(
                    1 for job in jobs if ticket.loaded[job.request_id] < job.end - job.start)
                ticket.complete()

    def _load(self, job: _Job, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> int:
        """Tokens of the job now in its blocks: the leading run of chunks that arrived."""
        chunk_tokens = self.saver.chunk_tokens
        assert chunk_tokens is not None
        cache = kv_caches[0]                 # [2, num_blocks, block_size, heads, head_dim]
        loaded_end = job.start
        with closing(self._fetcher.fetch(job.keys)) as chunks:   # stops the fetch on a break
            for offset, chunk in enumerate(chunks):
                if chunk is None or tuple(chunk.header.shape) != (
                        len(kv_caches), 2, chunk.key.num_tokens, *cache.shape[3:]) or (
                        TORCH_DTYPES[chunk.key.dtype] != cache.dtype):
                    break
                window = (job.first_chunk + offset) * chunk_tokens
                first = max(window, job.start)
                end = min(window + chunk.key.num_tokens, job.end)   # never the request's last
                scatter_tokens(kv_caches, chunk, job.block_ids, first - window, first,
                               end - first, layer_groups)
                self.num_chunks_loaded += 1
                loaded_end = window + chunk.key.num_tokens
        num_loaded = max(0, min(loaded_end, job.end) - job.start)
        self.num_tokens_loaded += num_loaded
        return num_loaded


def scatter_tokens(kv_caches: list[torch.Tensor], chunk: KvChunk,
                   group_block_ids: list[list[int]], first: int, position: int, num_tokens: int,
                   layer_groups: Sequence[int] | None = None) -> None:
    """Copies `num_tokens` tokens of the chunk, from its token `first`, into each layer's slots
    of the request's tokens from `position` on (`group_block_ids[g]` for a layer of KV group g,
    from `layer_groups`; None: every layer in group 0), on the current stream (the loader's,
    inside `StreamOrder.copying`). A partial last block is written token by token: the slots
    past it stay as they are. The chunk's layout is the saver's: [layers, 2, tokens, heads,
    head_dim]."""
    if num_tokens <= 0:
        return
    cache = kv_caches[0]
    block_size = cache.shape[2]
    groups = layer_groups if layer_groups is not None else [0] * len(kv_caches)
    with warnings.catch_warnings():      # a received frame is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(chunk.data, dtype=cache.dtype)
    tokens = flat.view(len(kv_caches), 2, -1, *cache.shape[3:])[:, :, first:first + num_tokens]
    slots = [token_slots(ids, position, num_tokens, block_size) for ids in group_block_ids]
    if cache.device.type != "cpu":
        tokens = tokens.to(cache.device)
        slots = [index.to(cache.device) for index in slots]
    for layer, (layer_cache, group) in enumerate(zip(kv_caches, groups, strict=True)):
        layer_cache.view(2, -1, *cache.shape[3:]).index_copy_(1, slots[group], tokens[layer])


def start_loads(loader: KvLoader | None, step: StepInput, input_batch: InputBatch,
                kv_caches: list[torch.Tensor], layer_groups: Sequence[int] | None = None
                ) -> LoadTicket | None:
    """The step's loads started (None when it has none); without a loader (no store) a
    completed ticket that loaded nothing, so every rank still reports and the scheduler
    recomputes."""
    if loader is not None:
        return loader.start(step, input_batch.requests, kv_caches, input_batch.block_size,
                            layer_groups)
    ids = [r.request_id for r in step.new_requests if r.num_load_tokens]
    if not ids:
        return None
    ticket = LoadTicket(step.step_id, ids)
    ticket.complete()
    return ticket
