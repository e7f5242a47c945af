"""`KvSaver`: copies each whole chunk of a request's computed KV out of the paged cache and
saves it to kvcache_svc's KV store in the background (issue 15, saving).

The runner calls it twice per step. `copy_out`, once the step's work is queued: for every
request whose `num_computed_tokens` now covers chunks not yet handed over, each such chunk of
this rank's slice (its layers, its KV heads) is copied into a staging buffer, on the device's
stream, so the copy reads the blocks before any later step can overwrite them (a request
aborted meanwhile may have its blocks reused by the very next step). Chunks already cached
when the worker first sees a request (a prefix hit) are not copied: the request that computed
them saved them. With KV groups (services.kv_groups) each layer's pages come from its group's
block table. A chunk some of whose blocks a sliding group never held here (the null block 0:
a prefix hit takes only the window's blocks) is not copied: its start was computed by the
request that cached it, and a chunk is saved whole or not at all. kvcache_svc keeps a sliding
group's blocks of the chunk in progress until the chunk is complete, so the step that
completes it still finds them all. `submit`, when the step finishes: the request's tokens up
to the chunk are all known on the host then (a greedy step's sampled token is read at finish,
and a decode may have computed it already), so the chunks are keyed there
(`services.kv_chunks`: the chained block hashes, with the request's cache salt, as the
scheduler computes them) and queued for the saver's thread. A step that fails gives its
copies up (`drop`).

The thread asks the store how many leading chunks it holds, sends only the chunks past those,
and logs `stored KV for N of M tokens (skip_leading_tokens=K)`. Saves never stall a step: the
staging buffers are the bounded queue (at most `max_queued_chunks`, pinned host memory on a
GPU); when none is free the chunk is skipped and counted, and never retried. Only whole chunks
are saved: a request's partial tail is not. The saver only reads the cache, so outputs are
the same with or without it. The chunk's layout: [num_layers, 2 (keys, values), chunk_tokens,
num_kv_heads, head_dim] of the rank's layers and heads, in the cache's dtype.
"""

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zmq

from services.block_hash import NONE_HASH, hash_full_blocks
from services.codec import Codec
from services.kv_chunks import KvSlice, chunk_keys, log_stored, skip_leading_tokens
from services.kv_store_client import KvStoreClient
from services.kv_store_wire import ChunkKey, FromKvStore
from services.kv_tensors import save_tensors
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
class PendingSave:
    """One request's chunks copied out in one step, keyed at `KvSaver.submit`."""

    state: RequestState
    chunk_indices: list[int]                  # chunk i covers [i * chunk_tokens, ...)
    buffers: list[torch.Tensor]               # [num_layers, 2, chunk_tokens, heads, head_dim]
    copied: torch.cuda.Event | None           # the copies are complete (GPU)


@dataclass(slots=True)
class _Job:
    keys: list[ChunkKey]                      # every chunk key of the request up to the last
    chunks: list[tuple[int, torch.Tensor]]    # (index in keys, its buffer)
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
        """Copies every chunk the step completed; call once the step's work is queued.
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
            if state.num_saved_chunks < 0:
                # First seen: chunks cached before it came (a prefix hit, or a resume after
                # preemption) were computed, and saved, by the request that computed them.
                state.num_saved_chunks = s.num_computed_tokens // chunk_tokens
            first, end = state.num_saved_chunks, state.num_computed_tokens // chunk_tokens
            if end <= first:
                continue
            state.num_saved_chunks = end
            save = PendingSave(state, [], [], None)
            for index in range(first, end):
                blocks = [ids[index * chunk_tokens // block_size:
                              (index + 1) * chunk_tokens // block_size]
                          for ids in state.block_ids]
                if any(0 in ids for ids in blocks):
                    continue                  # not held here: another request saved it
                buffer = self._take_buffer(kv_caches, chunk_tokens)
                if buffer is None:
                    self._count_skip()
                    continue
                gather_blocks(kv_caches, blocks, buffer, layer_groups)
                save.chunk_indices.append(index)
                save.buffers.append(buffer)
            if save.buffers:
                saves.append(save)
        if saves and kv_caches[0].device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
            for save in saves:
                save.copied = copied
        return saves

    def submit(self, saves: list[PendingSave], block_size: int) -> None:
        """Keys the chunks (their tokens are all on the host now) and queues them."""
        chunk_tokens = self.chunk_tokens
        assert chunk_tokens is not None
        for save in saves:
            state = save.state
            end = (save.chunk_indices[-1] + 1) * chunk_tokens
            if not extend_block_hashes(state, end, block_size):
                # A token of the chunk was never read back (its step failed): drop the save.
                self._release(save.buffers, num_failed=len(save.buffers))
                continue
            keys = chunk_keys(state.block_hashes[:end // block_size], block_size, chunk_tokens,
                              self.kv_slice)
            self._jobs.put(_Job(keys, list(zip(save.chunk_indices, save.buffers)),
                                save.copied))

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
        """Gives up chunks copied out by a step that then failed."""
        for save in saves:
            self._release(save.buffers, num_failed=len(save.buffers))

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
                    self._release([buffer for _, buffer in job.chunks])
        finally:
            client.close()
            self._ctx.term()

    def _save(self, client: KvStoreClient, job: _Job) -> None:
        if job.copied is not None:
            job.copied.synchronize()
        num_held = client.lookup(job.keys)
        chunks = [(job.keys[i], buffer) for i, buffer in job.chunks if i >= num_held]
        result = save_tensors(client, chunks)
        num_tokens = sum(key.num_tokens for key in job.keys)
        # A failed message ends the save: the chunks saved are the leading ones.
        num_saved = result.num_stored_chunks + result.num_held_chunks
        num_saved_tokens = sum(key.num_tokens for key, _ in chunks[:num_saved])
        with self._lock:
            self.num_chunks_stored += result.num_stored_chunks
            self.num_tokens_stored += num_saved_tokens
            self.num_chunks_held += result.num_held_chunks
            self.num_chunks_failed += result.num_failed_chunks
        log_stored(log, num_saved_tokens, num_tokens, skip_leading_tokens(job.keys, num_held))


def extend_block_hashes(state: RequestState, num_tokens: int, block_size: int) -> bool:
    """Hashes `state`'s full blocks up to `num_tokens` (a multiple of `block_size`) as the
    scheduler does (`scheduler_svc.request.Request.block_hashes`: the same chain and salt), so
    the chunk keys match the ones it will look up. False when a token there is not known."""
    start = len(state.block_hashes) * block_size
    tokens = state.token_ids[start:num_tokens]
    if len(state.token_ids) < num_tokens or (tokens and min(tokens) < 0):
        return False
    parent = state.block_hashes[-1] if state.block_hashes else NONE_HASH
    state.block_hashes += hash_full_blocks(state.token_ids[:num_tokens], block_size, parent,
                                           len(state.block_hashes), state.cache_salt)
    return True


def gather_blocks(kv_caches: list[torch.Tensor], group_block_ids: list[list[int]],
                  buffer: torch.Tensor, layer_groups: Sequence[int] | None = None) -> None:
    """Copies each layer's blocks (`group_block_ids[g]` for a layer of KV group g, from
    `layer_groups`; None: every layer in group 0) into `buffer` ([layers, 2, tokens, heads,
    dim])."""
    cache = kv_caches[0]
    groups = layer_groups if layer_groups is not None else [0] * len(kv_caches)
    indices = [torch.tensor(ids, dtype=torch.int64).to(cache.device, non_blocking=True)
               for ids in group_block_ids]
    blocks = buffer.view(len(kv_caches), 2, len(group_block_ids[0]), *cache.shape[2:])
    if cache.device.type == "cpu":
        for layer, (layer_cache, group) in enumerate(zip(kv_caches, groups, strict=True)):
            torch.index_select(layer_cache, 1, indices[group], out=blocks[layer])
        return
    gathered = torch.stack([layer_cache.index_select(1, indices[group])
                            for layer_cache, group in zip(kv_caches, groups, strict=True)])
    blocks.copy_(gathered, non_blocking=True)
