"""`KvSaver`: copies the new KV of each request's steps out of the paged cache and saves it to
kvcache_svc's KV store in the background (issue 15, saving; partial chunks: issue 24).

The runner calls it twice per step. `copy_out`, once the step's work is queued: for every
request whose `num_computed_tokens` moved past what was handed over, the new tokens of this
rank's slice (its layers, its KV heads) are copied into a staging buffer per chunk window
(`services.kv_chunks`: windows of chunk_tokens), on the device's stream, so the copy reads the
blocks before any later step can overwrite them (a request aborted meanwhile may have its
blocks reused by the very next step). What a step saves of a window: the tokens it computed
there when the window is complete, or when the step is a prefill step (it ends inside the
prompt: a prompt's tail is stored as a partial chunk, as LMCache does); decode tokens wait
until their window fills. A piece that continues a window this saver copied from the window's
start goes as an extension (only its new tokens, `ChunkHeader.base` naming the stored partial
chunk it continues); otherwise the window is copied from its start (the blocks hold it: a
prefix hit's blocks are the request's too). Tokens already cached when the worker first sees
a request (a prefix hit, a load) are not copied on their own: the request that computed them
saved them. With KV groups (services.kv_groups) each layer's pages come from its group's block
table. A piece some of whose blocks a sliding group never held here (the null block 0: a
prefix hit takes only the window's blocks) is not copied. kvcache_svc keeps a sliding group's
blocks of the chunk in progress until the chunk is complete, so the step that completes it
still finds them all. `submit`, when the step finishes: the request's tokens up to the piece
are all known on the host then (a greedy step's sampled token is read at finish, and a decode
may have computed it already), so the pieces are keyed there (the chained hash of their exact
token prefix, with the request's cache salt, as the scheduler computes it) and queued for the
saver's thread. A step that fails gives its copies up (`drop`).

The thread asks the store which leading pieces it holds, sends only the rest and logs
`stored KV for N of M tokens (skip_leading_tokens=K)`: M the request's tokens up to the last
piece, N those sent and newly stored, K = M minus the tokens sent (what the store held
before). Saves never stall a step: the staging buffers are the bounded queue (at most
`max_queued_chunks`, pinned host memory on a GPU); when none is free the piece is skipped and
counted, and never retried. The saver only reads the cache, so outputs are the same with or
without it. A chunk's layout: [num_layers, 2 (keys, values), tokens, num_kv_heads, head_dim]
of the rank's layers and heads, in the cache's dtype.
"""

import logging
import math
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zmq

from services.block_hash import NONE_HASH, hash_full_blocks
from services.codec import Codec
from services.kv_chunks import KvSlice, log_stored, make_chunk, prefix_hash, window_ends
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey, FromKvStore
from worker_svc.input_batch import RequestState, ScheduledRequest

log = logging.getLogger(__name__)

MAX_QUEUED_CHUNKS = 32         # staging buffers: chunks copied out and not yet sent
DESCRIBE_RETRY_S = 2.0         # until the store answers, nothing is saved


@dataclass(frozen=True, slots=True)
class KvStoreOptions:
    """How a runner reaches kvcache_svc's KV store; it builds its `KvSaver` and `KvLoader`
    from these (worker_svc.runner)."""

    address: str                                    # the store's tcp://HOST:PORT
    max_queued_chunks: int = MAX_QUEUED_CHUNKS      # staging buffers; past them, skip a save
    codec: Codec[FromKvStore] | None = None         # the client's (None: this process's key)


@dataclass(slots=True)
class Piece:
    """Tokens [start, end) of one chunk window (starting at `window`), copied out."""

    window: int                               # first token of the window
    start: int                                # the window's start, or an extension's first
    end: int                                  # one past the last token copied
    data: torch.Tensor                        # [num_layers, 2, end - start, heads, head_dim]
    buffer: torch.Tensor                      # the staging buffer `data` lies in

    @property
    def is_extension(self) -> bool:
        return self.start > self.window


@dataclass(slots=True)
class PendingSave:
    """One request's pieces copied out in one step, keyed at `KvSaver.submit`."""

    state: RequestState
    pieces: list[Piece]
    copied: torch.cuda.Event | None           # the copies are complete (GPU)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [piece.buffer for piece in self.pieces]


@dataclass(slots=True)
class _Job:
    num_tokens: int                           # the request's tokens up to the last piece
    chunks: list[tuple[ChunkKey, ChunkKey | None, Piece]]   # (key, base, piece), in order
    copied: torch.cuda.Event | None


class KvSaver:
    def __init__(self, address: str, kv_slice: KvSlice,
                 max_queued_chunks: int = MAX_QUEUED_CHUNKS,
                 codec: Codec[FromKvStore] | None = None) -> None:
        """`address`: the store's tcp://HOST:PORT. `kv_slice`: this rank's part of the
        model's KV. `codec`: the client's (None: this process's frame key)."""
        self.address = address
        self.kv_slice = kv_slice
        self.max_queued_chunks = max_queued_chunks
        self.chunk_tokens: int | None = None      # from the store, once it answers
        self.ready = threading.Event()            # chunk_tokens is known
        self.num_chunks_stored = 0                # newly stored by the store
        self.num_tokens_stored = 0
        self.num_chunks_held = 0                  # sent, but the store held them already
        self.num_saves_skipped = 0                # chunks skipped: no free staging buffer
        self.num_chunks_failed = 0                # sent, not stored (timeout, refusal, ...)
        self._warned_block_size = False
        self._free: list[torch.Tensor] = []
        self._num_buffers = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # The thread's own context and client (a client is not thread-safe): the step loop's
        # sockets never wait on the store.
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, args=(codec,), name="kv-saver",
                                        daemon=True)
        self._thread.start()
        log.info("saving KV chunks of layers [%d, %d), KV heads [%d, %d) to %s",
                 kv_slice.layer_start, kv_slice.layer_end, kv_slice.head_start,
                 kv_slice.head_end, address)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the thread after the queued saves (or after `timeout_s`)."""
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # ----------------------------------------------------------------------- the step's thread

    def copy_out(self, scheduled: Sequence[ScheduledRequest], kv_caches: list[torch.Tensor],
                 block_size: int, layer_groups: Sequence[int] | None = None
                 ) -> list[PendingSave]:
        """Copies every piece the step completed; call once the step's work is queued.
        `kv_caches`: one per layer; `layer_groups`: each layer's KV group (None: all 0)."""
        chunk_tokens = self.chunk_tokens
        if chunk_tokens is None or not kv_caches:
            return []
        if chunk_tokens % block_size:
            if not self._warned_block_size:
                log.warning("not saving KV: the store's chunks of %d tokens are no multiple of "
                            "the block size %d", chunk_tokens, block_size)
            self._warned_block_size = True
            return []
        saves: list[PendingSave] = []
        for s in scheduled:
            state = s.state
            if state.num_saved_tokens < 0:
                # First seen: tokens cached before it came (a prefix hit, a load, a resume
                # after preemption) were computed, and saved, by the request that computed
                # them.
                state.num_saved_tokens = state.save_from = s.num_computed_tokens
            pieces = self._copy_pieces(state, kv_caches, block_size, chunk_tokens,
                                       layer_groups)
            if pieces:
                saves.append(PendingSave(state, pieces, None))
        if saves and kv_caches[0].device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
            for save in saves:
                save.copied = copied
        return saves

    def _copy_pieces(self, state: RequestState, kv_caches: list[torch.Tensor],
                     block_size: int, chunk_tokens: int,
                     layer_groups: Sequence[int] | None) -> list[Piece]:
        """The pieces of `state`'s tokens computed since the last save, copied out."""
        start, end = state.num_saved_tokens, state.num_computed_tokens
        in_prompt = end <= state.num_prompt_tokens
        pieces: list[Piece] = []
        for window, piece_end in window_ends(start, end, chunk_tokens):
            if piece_end < window + chunk_tokens and not in_prompt:
                break                       # decode tokens: saved once their window fills
            state.num_saved_tokens = piece_end
            first = window if state.save_from > window else max(start, window)
            blocks = [ids[first // block_size:-(-piece_end // block_size)]
                      for ids in state.block_ids]
            if any(0 in ids for ids in blocks):
                state.save_from = piece_end   # not held here: another request saved it
                continue
            buffer = self._take_buffer(kv_caches, chunk_tokens)
            if buffer is None:
                self._count_skip()
                state.save_from = piece_end   # a gap: the window's next piece starts over
                continue
            cache = kv_caches[0]            # [2, num_blocks, block_size, heads, head_dim]
            shape = (len(kv_caches), 2, piece_end - first, *cache.shape[3:])
            data = buffer.view(-1)[:math.prod(shape)].view(shape)
            gather_tokens(kv_caches, blocks, first - first // block_size * block_size, data,
                          layer_groups)
            state.save_from = min(state.save_from, first)
            pieces.append(Piece(window, first, piece_end, data, buffer))
        return pieces

    def submit(self, saves: list[PendingSave], block_size: int) -> None:
        """Keys the pieces (their tokens are all on the host now) and queues them."""
        chunk_tokens = self.chunk_tokens
        assert chunk_tokens is not None
        for save in saves:
            state = save.state
            end = save.pieces[-1].end
            tokens = state.token_ids[:end]
            if (len(tokens) < end or min(tokens) < 0
                    or not extend_block_hashes(state, end // block_size * block_size,
                                               block_size)):
                # A token of the piece was never read back (its step failed): drop the save.
                self._release(save.buffers, num_failed=len(save.pieces))
                continue
            chunks = []
            for piece in save.pieces:
                key = self._key(state, piece.window, piece.end, block_size)
                base = (self._key(state, piece.window, piece.start, block_size)
                        if piece.is_extension else None)
                chunks.append((key, base, piece))
            self._jobs.put(_Job(end, chunks, save.copied))

    def _key(self, state: RequestState, window: int, end: int, block_size: int) -> ChunkKey:
        """The key of the chunk of `window`'s tokens up to `end`."""
        return self.kv_slice.key(prefix_hash(state.block_hashes, state.token_ids, end,
                                             block_size, state.cache_salt), end - window)

    @property
    def num_queued_chunks(self) -> int:
        """Chunks copied out and not yet sent (or given up)."""
        with self._lock:
            return self._num_buffers - len(self._free)

    def release_buffers(self) -> None:
        """Frees the staging buffers not in use (a worker placed again, before it measures
        its memory); chunks in flight keep theirs until sent."""
        with self._lock:
            self._num_buffers -= len(self._free)
            self._free = []

    def drop(self, saves: list[PendingSave]) -> None:
        """Gives up pieces copied out by a step that then failed."""
        for save in saves:
            self._release(save.buffers, num_failed=len(save.pieces))

    def _take_buffer(self, kv_caches: list[torch.Tensor], chunk_tokens: int
                     ) -> torch.Tensor | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._num_buffers >= self.max_queued_chunks:
                return None
            self._num_buffers += 1
        cache = kv_caches[0]                # [2, num_blocks, block_size, heads, head_dim]
        shape = (len(kv_caches), 2, chunk_tokens, *cache.shape[3:])
        return torch.empty(shape, dtype=cache.dtype, pin_memory=cache.device.type == "cuda")

    def _release(self, buffers: list[torch.Tensor], num_failed: int = 0) -> None:
        with self._lock:        # counters too: both threads count failures
            self._free += buffers
            self.num_chunks_failed += num_failed

    def _count_skip(self) -> None:
        if self.num_saves_skipped == 0:
            log.warning("KV save queue full (%d chunks): skipping chunks (counted in "
                        "num_saves_skipped)", self.max_queued_chunks)
        self.num_saves_skipped += 1

    # ---------------------------------------------------------------------- the saver's thread

    def _run(self, codec: Codec[FromKvStore] | None) -> None:
        client = KvStoreClient(self._ctx, self.address, codec=codec)
        try:
            while self.chunk_tokens is None:
                info = client.describe()
                if info is not None:
                    self.chunk_tokens = info.chunk_tokens
                    self.ready.set()
                    log.info("the KV store at %s takes chunks of %d tokens", self.address,
                             info.chunk_tokens)
                elif self._stop.wait(DESCRIBE_RETRY_S):
                    return
            while (job := self._jobs.get()) is not None:
                try:
                    self._save(client, job)
                finally:
                    self._release([piece.buffer for _, _, piece in job.chunks])
        finally:
            client.close()
            self._ctx.term()

    def _save(self, client: KvStoreClient, job: _Job) -> None:
        if job.copied is not None:
            job.copied.synchronize()
        num_held = client.lookup([key for key, _, _ in job.chunks])
        to_send = job.chunks[num_held:]
        result = client.save([make_chunk(key, tuple(piece.data.shape), tensor_bytes(piece.data),
                                         base) for key, base, piece in to_send])
        # A failed message ends the save: the pieces stored are among the leading ones.
        num_sent_tokens = sum(piece.end - piece.start for _, _, piece in to_send)
        num_stored_tokens = sum(piece.end - piece.start
                                for _, _, piece in to_send[:result.num_stored_chunks])
        with self._lock:
            self.num_chunks_stored += result.num_stored_chunks
            self.num_tokens_stored += num_stored_tokens
            self.num_chunks_held += result.num_held_chunks
            self.num_chunks_failed += result.num_failed_chunks
        log_stored(log, num_stored_tokens, job.num_tokens, job.num_tokens - num_sent_tokens)


def extend_block_hashes(state: RequestState, num_tokens: int, block_size: int) -> bool:
    """Hashes `state`'s full blocks up to `num_tokens` (a multiple of `block_size`) as the
    scheduler does (`scheduler_svc.engine.request.Request.block_hashes`: the same chain and
    salt), so the chunk keys match the ones it will look up. False when a token there is not
    known."""
    start = len(state.block_hashes) * block_size
    tokens = state.token_ids[start:num_tokens]
    if len(state.token_ids) < num_tokens or (tokens and min(tokens) < 0):
        return False
    parent = state.block_hashes[-1] if state.block_hashes else NONE_HASH
    state.block_hashes += hash_full_blocks(state.token_ids[:num_tokens], block_size, parent,
                                           len(state.block_hashes), state.cache_salt)
    return True


def token_slots(block_ids: list[int], first: int, num_tokens: int, block_size: int
                ) -> torch.Tensor:
    """Cache slots (block id * block_size + offset) of `num_tokens` tokens starting at offset
    `first` of `block_ids[0]`: the index into a cache viewed as [2, blocks * block_size, ...]."""
    positions = torch.arange(first, first + num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


def gather_tokens(kv_caches: list[torch.Tensor], group_block_ids: list[list[int]], first: int,
                  out: torch.Tensor, layer_groups: Sequence[int] | None = None) -> None:
    """Copies `out.shape[2]` tokens, from offset `first` of each layer's blocks
    (`group_block_ids[g]` for a layer of KV group g, from `layer_groups`; None: every layer in
    group 0), into `out` ([layers, 2, tokens, heads, dim])."""
    cache = kv_caches[0]                    # [2, num_blocks, block_size, heads, head_dim]
    block_size = cache.shape[2]
    groups = layer_groups if layer_groups is not None else [0] * len(kv_caches)
    slots = [token_slots(ids, first, out.shape[2], block_size).to(cache.device,
                                                                  non_blocking=True)
             for ids in group_block_ids]
    flat = [c.view(2, -1, *c.shape[3:]) for c in kv_caches]
    if cache.device.type == "cpu":
        for layer, (layer_cache, group) in enumerate(zip(flat, groups, strict=True)):
            torch.index_select(layer_cache, 1, slots[group], out=out[layer])
        return
    gathered = torch.stack([layer_cache.index_select(1, slots[group])
                            for layer_cache, group in zip(flat, groups, strict=True)])
    out.copy_(gathered, non_blocking=True)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data
