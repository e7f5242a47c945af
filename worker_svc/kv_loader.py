"""`KvLoader`: fetches KV chunks from kvcache_svc's KV store into a request's blocks (issue 15,
loading; issue 24, layer-wise loads).

A step may carry requests with `NewRequest.num_load_tokens`: kvcache_svc found those tokens
(past the request's prefix hit) in the store for every rank. `start` keys their chunks on the
step's thread (the same chained hashes and cache salt the saver uses,
`kv_saver.extend_block_hashes`) and the loader's thread fetches them through
worker_svc.kv_fetcher, a message or two ahead, so copying one into the cache overlaps the next
one's transfer. Each chunk in the leading run that arrived intact (the client checks key, sizes
and checksum) is copied into the request's own blocks past its prefix hit; a chunk that is
gone, damaged or late ends the run there. The ticket (worker_svc.load_ticket) gives, per
request, how many of its load tokens are now in the cache: the worker reports that in a
`KvLoaded`, and the scheduler resumes from the smallest count any rank reported. Nothing here
raises into the step: a failure is a short count.

A load is one of two kinds (the ticket's doc has both):
- layer-wise, when the request also has `num_new_tokens`: its step computes the rest of its
  prompt, the forward waiting before each layer for that layer's KV. The loader fetches a
  range of layers of every chunk per message, group by group (`LAYER_GROUPS`), so the forward
  runs on the first layers while the last are on their way. After the forward,
  `settle_inline_loads` agrees on the counts over the TP group and rolls a short one back;
- in the background otherwise (kvcache_svc loads only part of a hit under memory pressure, and
  the scheduler asks for no layer-wise load with pipeline stages): a chunk per message; the
  request computes nothing in that step, whose forward runs the other requests meanwhile.

The worker sends a step's output without waiting for background loads, and each rank sends its
`KvLoaded` once the ticket completes (worker_svc.step_loop). The scheduler holds the request
meanwhile, so only a step that names it in `finished_ids` (aborted, or every request
preempted) can come first, and the blocks it frees may be handed out by that very step:
`wait_for` holds such a step until the loads naming those requests are done.

On a GPU the copies go through a stream of the loader's own, ordered against the compute
stream by CUDA events both ways (`StreamOrder`): the loader's stream waits for everything
queued on the compute stream when the load started (a step still in flight may touch blocks
freed before it and handed to the loading request), and the compute stream waits for the
loader's last copy before the next step that can read the blocks (`join_loads`, called at
every launch), or for a layer group's copies before that group's layers (`wait_layer`). The
host also synchronizes the loader's stream before the ticket completes, so a KvLoaded is sent
only once the KV is in place.
"""

import logging
import queue
import threading
import time
import warnings
from collections.abc import Sequence
from contextlib import closing, nullcontext
from dataclasses import dataclass, replace

import torch

from services.codec import Codec
from services.kv_chunks import KvChunk, prefix_chunk_keys
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey, FromKvStore
from services.kv_tensors import TORCH_DTYPES
from services.wire import StepInput
from worker_svc.input_batch import InputBatch, RequestState, ScheduledRequest
from worker_svc.kv_fetcher import ChunkFetcher
from worker_svc.kv_saver import KvSaver, extend_block_hashes, token_slots
from worker_svc.load_ticket import LoadTicket, StreamOrder, layer_group_ends
from worker_svc.model.tensor_parallel import TpGroup

log = logging.getLogger(__name__)

LAYER_GROUPS = 6        # a layer-wise load fetches its chunks in this many ranges of layers


@dataclass(frozen=True, slots=True)
class _Job:
    request_id: str
    keys: list[ChunkKey]        # chunks first_chunk, first_chunk + 1, ...: the last may be partial
    first_chunk: int            # window i covers tokens [i * chunk_tokens, (i + 1) * ...)
    start: int                  # first token to write (the prefix hit's end: whole blocks)
    end: int                    # one past the last token to load
    block_ids: list[list[int]]  # the request's blocks, per KV group


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
        # Layer-wise ("inline") loads first: the step's forward waits for them.
        loads.sort(key=lambda r: r.num_new_tokens == 0)
        inline = [r.request_id for r in loads if r.num_new_tokens]
        ticket = LoadTicket(step.step_id, [r.request_id for r in loads], inline,
                            layer_group_ends(len(kv_caches), LAYER_GROUPS) if inline else ())
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
            ticket.order = order
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
            inline = set(ticket.inline_ids)
            started = time.perf_counter()
            try:
                with order.copying(ticket.ready) if order is not None else nullcontext():
                    if inline:
                        self._load_layerwise(ticket, [j for j in jobs if j.request_id in inline],
                                             kv_caches, layer_groups, order)
                        log.info("loaded KV of %d of %d tokens layer by layer (%d groups of "
                                 "layers) for %d request(s) in %.0f ms",
                                 sum(ticket.loaded[rid] for rid in inline),
                                 sum(j.end - j.start for j in jobs if j.request_id in inline),
                                 len(ticket.layer_ends), len(inline),
                                 (time.perf_counter() - started) * 1e3)
                    ticket.inline_done()
                    for job in jobs:
                        if job.request_id not in inline:
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
        """Tokens of the job now in its blocks: the leading run of chunks that arrived (one
        message per chunk, each copied while the next is on its way)."""
        num_chunks = 0
        with closing(self._fetcher.fetch(job.keys)) as chunks:   # stops the fetch on a break
            for chunk in chunks:
                if not self._copy(job, num_chunks, chunk, kv_caches, layer_groups, None):
                    break
                num_chunks += 1
        return self._count(job, num_chunks)

    def _load_layerwise(self, ticket: LoadTicket, jobs: list[_Job], kv_caches: list[torch.Tensor],
                        layer_groups: list[int], order: StreamOrder | None) -> None:
        """The inline loads, one group of layers at a time (one message per group and job, a
        group or two ahead): group g of every job is copied, then `group_done(g)` lets the
        forward past those layers. A job's count is the shortest run of chunks any group got
        (a later group copies only that many)."""
        runs = {job.request_id: len(job.keys) for job in jobs}
        ranges = list(zip([0, *ticket.layer_ends], ticket.layer_ends))
        batches = [(job.keys, layers) for layers in ranges for job in jobs]
        with closing(self._fetcher.fetch_batches(batches)) as arriving:
            for group, layers in enumerate(ranges):
                for job in jobs:
                    chunks = next(arriving, [])
                    run = 0
                    while run < min(runs[job.request_id], len(chunks)) and self._copy(
                            job, run, chunks[run], kv_caches, layer_groups, layers):
                        run += 1
                    runs[job.request_id] = run
                if order is not None:
                    ticket.group_copied[group] = order.mark_group()
                ticket.group_done(group)
        for job in jobs:
            ticket.loaded[job.request_id] = self._count(job, runs[job.request_id])

    def _copy(self, job: _Job, index: int, chunk: KvChunk | None, kv_caches: list[torch.Tensor],
              layer_groups: list[int], layers: tuple[int, int] | None) -> bool:
        """Copies chunk `index` of the job (its layers `layers`; None: all) into its blocks;
        False when it is missing or not the job's shape (the run ends there)."""
        chunk_tokens = self.saver.chunk_tokens
        assert chunk_tokens is not None
        cache = kv_caches[0]                 # [2, num_blocks, block_size, heads, head_dim]
        lo, hi = layers if layers is not None else (0, len(kv_caches))
        if chunk is None or tuple(chunk.header.shape) != (
                hi - lo, 2, chunk.key.num_tokens, *cache.shape[3:]) or (
                TORCH_DTYPES[chunk.key.dtype] != cache.dtype):
            return False
        window = (job.first_chunk + index) * chunk_tokens
        first = max(window, job.start)
        end = min(window + chunk.key.num_tokens, job.end)   # never the request's last token
        scatter_tokens(kv_caches, chunk, job.block_ids, first - window, first, end - first,
                       layer_groups, lo)
        if hi == len(kv_caches):
            self.num_chunks_loaded += 1
        return True

    def _count(self, job: _Job, num_chunks: int) -> int:
        """Tokens of the job in its blocks once its first `num_chunks` chunks are."""
        chunk_tokens = self.saver.chunk_tokens
        assert chunk_tokens is not None
        loaded_end = job.start
        if num_chunks:
            loaded_end = ((job.first_chunk + num_chunks - 1) * chunk_tokens
                          + job.keys[num_chunks - 1].num_tokens)
        num_loaded = max(0, min(loaded_end, job.end) - job.start)
        self.num_tokens_loaded += num_loaded
        return num_loaded


def scatter_tokens(kv_caches: list[torch.Tensor], chunk: KvChunk,
                   group_block_ids: list[list[int]], first: int, position: int, num_tokens: int,
                   layer_groups: Sequence[int] | None = None, first_layer: int = 0) -> None:
    """Copies `num_tokens` tokens of the chunk, from its token `first`, into each layer's slots
    of the request's tokens from `position` on (`group_block_ids[g]` for a layer of KV group g,
    from `layer_groups`; None: every layer in group 0), on the current stream (the loader's,
    inside `StreamOrder.copying`). A partial last block is written token by token: the slots
    past it stay as they are. The chunk's layout is the saver's: [layers, 2, tokens, heads,
    head_dim]; its layers are the stage's from `first_layer` on (a layer range's chunk)."""
    if num_tokens <= 0:
        return
    cache = kv_caches[0]
    block_size = cache.shape[2]
    groups = layer_groups if layer_groups is not None else [0] * len(kv_caches)
    with warnings.catch_warnings():      # a received frame is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(chunk.data, dtype=cache.dtype)
    num_layers = chunk.header.shape[0]
    tokens = flat.view(num_layers, 2, -1, *cache.shape[3:])[:, :, first:first + num_tokens]
    slots = [token_slots(ids, position, num_tokens, block_size) for ids in group_block_ids]
    if cache.device.type != "cpu":
        tokens = tokens.to(cache.device)
        slots = [index.to(cache.device) for index in slots]
    if cache.element_size() == 1:        # float8: CPU torch copies its bytes, not its values
        tokens = tokens.view(torch.uint8)
    for offset in range(num_layers):
        layer = first_layer + offset
        target = kv_caches[layer]
        if target.element_size() == 1:
            target = target.view(torch.uint8)
        target.view(2, -1, *cache.shape[3:]).index_copy_(1, slots[groups[layer]],
                                                        tokens[offset])


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
    ticket = LoadTicket(step.step_id, ids, [r.request_id for r in step.new_requests
                                            if r.num_load_tokens and r.num_new_tokens])
    ticket.complete()
    return ticket


def settle_inline_loads(loads: LoadTicket, scheduled: list[ScheduledRequest],
                        tp: TpGroup | None, device: torch.device) -> set[str]:
    """After a forward that computed on layer-wise loads: what every rank's loads got, agreed
    over the TP group (a rank without its KV slice poisons every rank's rows through the
    all-reduces). A request whose load came back short computed on missing KV: it rolls back
    to what was loaded, and the runner samples and saves nothing of it; the scheduler, told
    the same count (every rank reports it), recomputes the rest. Returns their ids."""
    counts = loads.inline_loaded()
    ids = list(counts)
    agreed = [counts[rid] for rid in ids]
    if tp is not None:
        agreed = tp.agree_min(agreed, device)
    by_id = {s.state.request_id: s for s in scheduled}
    short: set[str] = set()
    for rid, num in zip(ids, agreed, strict=True):
        loads.loaded[rid] = num
        s = by_id.get(rid)
        if s is None or s.state.load_start is None:
            continue
        if num < s.num_computed_tokens - s.state.load_start:
            short.add(rid)
            s.state.num_computed_tokens = s.state.load_start + num
    return short


def not_sampling(requests: list[ScheduledRequest], ids: set[str]) -> list[ScheduledRequest]:
    """`requests` with those of `ids` sampling nothing."""
    if not ids:
        return requests
    return [replace(s, samples=False) if s.state.request_id in ids else s for s in requests]
