"""Messages between the scheduler and kvcache_svc, and kvcache_svc's KV events feed.

MessagePack-encoded msgspec structs on the same base and limits as `services.wire` (the step
messages). Scheduler -> kvcache_svc: `PlanRequest` (the step's grows and admissions),
`ConfigurePool`, `DropPool`, `PrefixQuery`; kvcache_svc answers `PlanReply`, `KvAck` or
`PrefixReply`, and publishes every prefix-index change as a `KvEventBatch` (PUB/SUB, members
of the cluster only).
"""

import time
from typing import Annotated

import msgspec
from msgspec import Meta

from services.kv_store_wire import KvSlice, StoreStats
from services.wire import (
    MAX_KV_GROUPS,
    MAX_REQUESTS_PER_STEP,
    BlockHash,
    BlockHashes,
    Count,
    GroupBlockIds,
    RequestId,
    RequestIds,
    Window,
    _Wire,
)

# ---------------------------------------------------------------------- scheduler <-> kvcache_svc

MAX_REPLICAS = 1 << 12              # pools one kvcache_svc holds at once
MAX_RANKS = 1 << 10                 # ranks of one replica
# A batch holds a few runs of events (removed, then stored) per grow or admit op and KV group,
# plus a few more where a run is split at MAX_BLOCKS_PER_REQUEST hashes.
MAX_EVENTS_PER_BATCH = 1 << 20

# The kvcache_svc instance: its start time in nanoseconds since the Unix epoch. A new value in
# any reply means kvcache_svc restarted and every pool is gone: the scheduler preempts all
# running requests and configures its pools again.
Epoch = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # msgspec bounds must fit an int64

# Epochs are start times. One further ahead than this clock skew is refused by its receiver:
# a newer epoch supersedes the older one, so an epoch of 2**63 - 1 would lock out every real
# restart of that process until its receiver restarted too.
MAX_EPOCH_SKEW_NS = 24 * 3600 * 10**9


def future_epoch(epoch: int, now_ns: int | None = None) -> str | None:
    """Why `epoch` cannot be a real start time, or None if it can."""
    now = time.time_ns() if now_ns is None else now_ns
    if epoch > now + MAX_EPOCH_SKEW_NS:
        return (f"epoch {epoch} is more than a day ahead of this host's clock ({now}); an "
                f"epoch is the process's start time in ns since the Unix epoch")
    return None


class GrowOp(_Wire):
    """Make a running request's blocks cover `num_tokens` tokens."""

    request_id: RequestId
    # Tokens the blocks must hold after this step: its computed tokens, and possibly a few
    # blocks' worth more (the scheduler grows ahead so that steady decodes need no plan).
    num_tokens: Count
    # Hashes of blocks that become full with this step and were not committed before, in block
    # order; they enter the prefix index (prefix caching on).
    new_block_hashes: BlockHashes
    # Tokens in the cache before this step (its queries start there): sliding groups give
    # back the blocks no query of this step or a later one reads (`kv_groups.
    # first_kept_block`). At most num_tokens; 0 frees nothing.
    num_computed_tokens: Count = 0


class AdmitOp(_Wire):
    """Admit a waiting request: reuse its longest cached prefix, allocate for the rest."""

    request_id: RequestId
    num_tokens: Count                   # every known token of the request
    block_hashes: BlockHashes           # hashes of its full blocks, in order
    max_num_new_tokens: Annotated[int, Meta(ge=1, lt=1 << 31)]  # token budget given to it
    allow_partial: bool                 # chunked prefill: may schedule fewer than all tokens
    # Chained hash of all num_tokens tokens when the last block is partial (the KV store's key
    # of a partial last chunk, services.kv_chunks.prefix_hash); None otherwise.
    tail_hash: BlockHash | None = None
    # A store hit's step also computes the tokens after it (a layer-wise load, whose forward
    # waits for each layer's KV: worker_svc.load_ticket); False: the hit loads alone.
    compute_after_load: bool = False


class CommitOp(_Wire):
    """Enter the hashes of a held request's blocks that became full into the prefix index,
    without growing it: a request about to be freed (finished or preempted) whose last full
    blocks were computed since its last grow (the scheduler plans only when blocks or
    admissions change, so commits wait for the next plan)."""

    request_id: RequestId
    new_block_hashes: BlockHashes       # the blocks after its committed ones, in block order


class PlanRequest(_Wire):
    """One step's batched block plan for one replica, applied in field order.

    Commits first (`commits`, the last field: positional encoding adds fields at the end);
    then frees; then grows in order (a grow that does not fit fails alone); then admissions
    in order, stopping at the first that does not fit (first come, first served).
    """

    replica_id: Count
    plan_id: Count                      # echoed in the reply
    free_ids: RequestIds                # requests whose blocks are released (reverse order)
    grows: Annotated[list[GrowOp], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    admits: Annotated[list[AdmitOp], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    commits: Annotated[list[CommitOp], Meta(max_length=MAX_REQUESTS_PER_STEP)] = []


class AdmitResult(_Wire):
    request_id: RequestId
    num_cached_tokens: Count            # prefix served from cache (at most num_tokens - 1)
    num_new_tokens: Count               # tokens to compute this step (after any load)
    block_ids: GroupBlockIds            # per KV group, the request's table (null 0: not held)
    num_committed_blocks: Count         # of block_hashes, how many the index now holds
    # Tokens after the cached prefix that the KV store holds for every rank's slice: the
    # request loads them this step, and computes num_new_tokens after them (AdmitOp.
    # compute_after_load) or nothing (its blocks cover them; loaded and computed blocks enter
    # the prefix index only with the step after the load, once every rank reported it).
    num_load_tokens: Count = 0


class PlanReply(_Wire):
    plan_id: Count
    # Per grow op, in order: the block ids appended to each KV group, or None when it did not
    # fit.
    grown: Annotated[list[GroupBlockIds | None], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    admitted: Annotated[list[AdmitResult], Meta(max_length=MAX_REQUESTS_PER_STEP)]
    num_free_blocks: Count              # free + evictable blocks after this plan
    error: Annotated[str, Meta(max_length=4096)] | None  # the plan was refused as a whole
    epoch: Epoch                        # kvcache_svc instance that answered (see Epoch)


class ConfigurePool(_Wire):
    """Create (or re-create, dropping all state) the block pool of one replica.

    `scheduler_epoch` is the scheduler instance's start time (ns). A newer one means the
    scheduler restarted: kvcache_svc drops every pool of the previous instance first (their
    replicas no longer exist). An older one is refused: a scheduler that was replaced must not
    take pools back."""

    replica_id: Count
    num_blocks: Annotated[int, Meta(ge=2, lt=1 << 31)]   # including the null block 0
    block_size: Annotated[int, Meta(ge=1, le=1024)]
    enable_prefix_caching: bool
    scheduler_epoch: Epoch = 0
    # Every rank's part of the replica's KV in the store (in rank order), when its workers load
    # from kvcache_svc's store; empty: admissions never load.
    store_slices: Annotated[list[KvSlice], Meta(max_length=MAX_RANKS)] = []
    # The model's KV groups' windows, in group order (`KvGroupLayout.windows`): one block
    # table per group per request, sliding groups freeing what their window left.
    group_windows: Annotated[list[Window], Meta(min_length=1, max_length=MAX_KV_GROUPS)] = \
        msgspec.field(default_factory=lambda: [0])


class DropPool(_Wire):
    """Forget one replica's pool and prefix index (the replica went down)."""

    replica_id: Count


class KvAck(_Wire):
    """Answer to ConfigurePool and DropPool, and to any message kvcache_svc failed to handle."""

    error: Annotated[str, Meta(max_length=4096)] | None
    epoch: Epoch                        # kvcache_svc instance that answered (see Epoch)
    # ConfigurePool: the chunk size in tokens of the KV store that the workers save to, when
    # kvcache_svc runs one: sliding groups keep a chunk's blocks until it is complete (and
    # copied out), `kv_groups.first_kept_block`; 0: no store, windows alone decide.
    save_chunk_tokens: Count = 0


class PrefixQuery(_Wire):
    """How much of a prompt each replica has cached (prefix-aware routing). Changes nothing:
    no LRU touch, no reference taken, so the answer may be stale by the time a plan runs."""

    block_hashes: BlockHashes           # chained hashes of the prompt's full blocks, in order


class ReplicaPrefix(_Wire):
    replica_id: Count
    # Leading block_hashes the replica's prefix index can serve as an admission would (every
    # KV group: a full group from block 0, a sliding one its window's blocks). Not capped at
    # num_tokens - 1 tokens as an admission is: the caller applies that cap.
    num_cached_blocks: Count
    # Leading block_hashes whose KV the store holds for this replica's slices (whole chunks
    # only): an admission loads them, so every replica of the same layout reaches them.
    num_stored_blocks: Count = 0


class PrefixReply(_Wire):
    epoch: Epoch                        # kvcache_svc instance that answered (see Epoch)
    # One entry per configured pool, by ascending replica_id; 0 blocks when nothing matches.
    replicas: Annotated[list[ReplicaPrefix], Meta(max_length=MAX_REPLICAS)]
    store: StoreStats | None = None     # the KV store's counters (None: no store)


ToKvCache = PlanRequest | ConfigurePool | DropPool | PrefixQuery
FromKvCache = PlanReply | KvAck | PrefixReply

# ------------------------------------------------------------------------------------ KV events
# kvcache_svc -> any subscriber (ZMQ PUB, one KvEventBatch per frame, no topic frame): the
# changes to one replica's prefix index made by one operation (a plan, a configure, a drop, an
# admin Clear), in the order they happened. Applied in seq order from seq 0 of an epoch, the
# batches rebuild every replica's index exactly. A seq gap means batches were lost (PUB drops
# when a subscriber falls behind or joins late): the subscriber's copy is then approximate, and
# PrefixQuery gives exact answers. A new epoch means a new instance: forget everything.


class BlockStored(_Wire):
    """Hashes that entered the replica's prefix index, in block order."""

    block_hashes: BlockHashes
    # The KV group whose index holds them (each group has its own; group 0 is the first full
    # attention group, the one to follow for a prompt's cached prefix).
    group: Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)] = 0


class BlockRemoved(_Wire):
    """Hashes that left the index: their cached blocks were reused for another allocation, or
    dropped by an admin Clear."""

    block_hashes: BlockHashes
    group: Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)] = 0  # as in BlockStored


class AllBlocksCleared(_Wire):
    """The replica's index is empty: its pool was re-configured or dropped, or an admin Clear
    emptied it. Everything stored before on this replica is gone."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(_Wire):
    epoch: Epoch                        # kvcache_svc instance that published (see Epoch)
    seq: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # from 0 per epoch, +1 per batch published
    replica_id: Count
    events: Annotated[list[KvEvent], Meta(max_length=MAX_EVENTS_PER_BATCH)]
