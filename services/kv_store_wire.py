"""KV store messages: chunks of computed KV between workers, kvcache_svc's store and the
scheduler (issue 15). Split from `services.wire` (the step messages), which uses `KvSlice` and
`StoreStats` from here; the same rules hold: msgspec structs, array-like and tagged, decoded
with validation and size limits by `services.codec`, never pickled.

Computed KV kept by kvcache_svc in chunks (a rank's slice of the KV of `num_tokens` tokens;
services.kv_chunks cuts and keys them). A message is a ZMQ multipart: one header frame through
the Codec (so the cluster-token HMAC covers it), then one raw data frame per ChunkHeader, in
order. The header's checksum (BLAKE3-256 of the data frame) is verified before data is stored
or taken, so the authenticated header vouches for the data; it covers each layer's slice on
its own, so a range of layers is checked as a chunk of its own. Data frames are never msgpack.
"""

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from services.block_hash import BLOCK_HASH_BYTES
from services.rpc.splitserve.v1 import kvcache_pb2


class _Wire(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """Base of every store struct: positional encoding, tagged with the class name."""


BlockHash = Annotated[bytes, Meta(min_length=BLOCK_HASH_BYTES, max_length=BLOCK_HASH_BYTES)]
Count = Annotated[int, Meta(ge=0, lt=1 << 40)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]

KvDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]  # torch names
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                  "float8_e5m2": 1}
MAX_CHUNK_TOKENS = 1 << 16          # tokens in one chunk
MAX_CHUNK_BYTES = 1 << 29           # one data frame; receiving sockets refuse a larger frame
MAX_CHUNKS_PER_MESSAGE = 1 << 16    # headers or keys in one message (or one key list)
MAX_KEY_LISTS = 1 << 10             # key lists in one LookupChunks
MAX_STORE_DATA_BYTES = 1 << 30      # data frames of one message together (senders split above)
MAX_STORE_HEADER_BYTES = 16 << 20   # one header frame (before its HMAC tag)
CHUNK_CHECKSUM_BYTES = 32           # BLAKE3-256 (services.kv_chunks.chunk_checksum)
MAX_CHUNK_SLICES = 1024             # a chunk's first dimension (its layers), checksummed each
SliceIndex = Annotated[int, Meta(ge=0, le=1 << 16)]


class KvSlice(_Wire, frozen=True):
    """The part of a model's KV one rank holds: what every one of its chunk keys shares. A
    worker reports it with its capacity, and the scheduler hands every rank's slice to
    kvcache_svc with the replica's pool, so admission can ask the store for each."""

    model: ModelName                    # names the weights (two models must never share one)
    dtype: KvDtype                      # KV element type
    layer_start: SliceIndex             # first layer of the rank (pipeline stage)
    layer_end: SliceIndex               # one past its last layer
    head_start: SliceIndex              # first KV head of the rank (tensor-parallel slice)
    head_end: SliceIndex                # one past its last KV head

    def __post_init__(self) -> None:    # while decoding, msgspec makes this a ValidationError
        _check_slice(self.layer_start, self.layer_end, self.head_start, self.head_end)

    def key(self, block_hash: bytes, num_tokens: int) -> "ChunkKey":
        return ChunkKey(block_hash, num_tokens, self.model, self.dtype, self.layer_start,
                        self.layer_end, self.head_start, self.head_end)


def _check_slice(layer_start: int, layer_end: int, head_start: int, head_end: int) -> None:
    if layer_start >= layer_end or head_start >= head_end:
        raise ValueError(f"empty slice: layers [{layer_start}, {layer_end}), "
                         f"KV heads [{head_start}, {head_end})")


class ChunkKey(_Wire, frozen=True):
    """Which stored chunk; equal keys mean equal KV. The chained hash fixes every token up to
    the chunk's end, so a chunk is only ever found after its exact prefix."""

    block_hash: BlockHash               # chained hash of the chunk's last block (block_hash.py)
    num_tokens: Annotated[int, Meta(ge=1, le=MAX_CHUNK_TOKENS)]  # tokens of KV, ending there
    model: ModelName                    # weights the KV came from
    dtype: KvDtype                      # element type of the data
    layer_start: SliceIndex             # first layer of the rank's slice
    layer_end: SliceIndex               # one past its last layer
    head_start: SliceIndex              # first KV head of the rank's slice
    head_end: SliceIndex                # one past its last KV head

    def __post_init__(self) -> None:
        _check_slice(self.layer_start, self.layer_end, self.head_start, self.head_end)


Checksum = Annotated[bytes, Meta(min_length=CHUNK_CHECKSUM_BYTES, max_length=CHUNK_CHECKSUM_BYTES)]


class ChunkHeader(_Wire, frozen=True):
    """One chunk's data frame, described; the frame itself follows the message's header."""

    key: ChunkKey
    shape: Annotated[tuple[Annotated[int, Meta(ge=1, lt=1 << 31)], ...],
                     Meta(min_length=1, max_length=8)]   # elements per dimension (layout: caller's)
    num_bytes: Annotated[int, Meta(ge=1, le=MAX_CHUNK_BYTES)]  # of the data frame
    checksum: Checksum                  # BLAKE3-256 of `slice_checksums`, concatenated
    # Set on a save that continues a stored partial chunk (services.kv_chunks): the data holds
    # only the tokens past `base`, which the store appends to it; None: the data is the chunk.
    base: "ChunkKey | None" = None
    # BLAKE3-256 of each slice of the data along its first dimension (one per layer of KV), so
    # a range of layers is checked on its own: the store serves a layer-wise load's ranges
    # without hashing them again (services.kv_chunks.layer_range).
    slice_checksums: Annotated[tuple[Checksum, ...], Meta(max_length=MAX_CHUNK_SLICES)] = ()


ChunkKeys = Annotated[list[ChunkKey], Meta(max_length=MAX_CHUNKS_PER_MESSAGE)]


class SaveChunks(_Wire):
    """Store these chunks (one data frame per header follows). One bad frame refuses the whole
    message; chunks already held are skipped and kept."""

    chunks: Annotated[list[ChunkHeader], Meta(max_length=MAX_CHUNKS_PER_MESSAGE)]


class SaveReply(_Wire):
    num_stored_chunks: Count            # newly stored (the rest fit no tier or were held)
    num_held_chunks: Count              # already held, skipped


class LookupChunks(_Wire):
    """How many leading chunks of each key list are held (a chunk is only useful after every
    chunk before it). Changes nothing, so the answer may be stale by the time of a load."""

    key_lists: Annotated[list[ChunkKeys], Meta(max_length=MAX_KEY_LISTS)]


class LookupReply(_Wire):
    num_leading_chunks: Annotated[list[Count], Meta(max_length=MAX_KEY_LISTS)]  # per key list


class LoadChunks(_Wire):
    keys: ChunkKeys                     # the chunks to send
    # Only layers [start, end) of each chunk, counted from its first layer (a layer-wise
    # load, worker_svc.kv_loader); None: whole chunks. A chunk with fewer layers is a miss.
    layers: "tuple[SliceIndex, SliceIndex] | None" = None

    def __post_init__(self) -> None:
        if self.layers is not None and not self.layers[0] < self.layers[1]:
            raise ValueError(f"empty layer range {list(self.layers)}")


class LoadReply(_Wire):
    """Per key, in order: its header, or None for a miss (not held, or dropped as corrupt); one
    data frame follows per header. For a layer range, the header describes the range's data
    (its shape's first dimension is the range's layers, its checksum the range's). Answers a
    prefix of the keys (at least one) when all would pass MAX_STORE_DATA_BYTES: the caller asks
    again for the rest."""

    chunks: Annotated[list[ChunkHeader | None], Meta(max_length=MAX_CHUNKS_PER_MESSAGE)]


class DescribeStore(_Wire):
    """What the store expects of its callers (answered by StoreInfo)."""


class StoreInfo(_Wire):
    chunk_tokens: Annotated[int, Meta(ge=1, le=MAX_CHUNK_TOKENS)]  # tokens per full chunk


class StoreRefused(_Wire):
    """The request was malformed (frames, sizes, checksums) and changed nothing."""

    error: Annotated[str, Meta(max_length=4096)]


class TierStats(_Wire, frozen=True):
    """One tier of the store, now and since start."""

    name: Annotated[str, Meta(max_length=64)]   # "memory", "disk", ...
    capacity_bytes: Count               # the tier's byte budget
    num_chunks: Count                   # chunks held now
    num_bytes: Count                    # bytes used now (on disk: whole files)
    num_evicted_chunks: Count           # pushed out to make room, since start
    num_dropped_chunks: Count           # found corrupt or truncated and deleted, since start


class StoreStats(_Wire, frozen=True):
    """The store's counters since start (kvcache_svc's admin Stats, and the scheduler's
    ServerInfo and /metrics through its kvcache_svc probe)."""

    chunk_tokens: Annotated[int, Meta(ge=1, le=MAX_CHUNK_TOKENS)]  # tokens per full chunk
    num_hit_tokens: Count               # admissions: tokens held past the prefix hit
    num_miss_tokens: Count              # admissions: tokens of the chunks not held
    num_stored_chunks: Count            # saved and newly stored
    num_stored_tokens: Count
    num_stored_bytes: Count
    num_skipped_tokens: Count           # saved but already held (a caller that did not look)
    num_loaded_chunks: Count            # served to loads
    num_loaded_tokens: Count
    num_loaded_bytes: Count
    num_load_miss_tokens: Count         # asked for but not held (evicted or dropped since)
    tiers: Annotated[tuple[TierStats, ...], Meta(max_length=16)]  # fastest first

    def tier(self, name: str) -> TierStats | None:
        return next((tier for tier in self.tiers if tier.name == name), None)


ToKvStore = SaveChunks | LookupChunks | LoadChunks | DescribeStore
FromKvStore = SaveReply | LookupReply | LoadReply | StoreInfo | StoreRefused


def store_stats_to_pb(stats: StoreStats) -> kvcache_pb2.StoreStats:
    """The stats as the admin API and ServerInfo carry them (one proto message for both)."""
    tiers = [kvcache_pb2.StoreTierStats(
        name=t.name, capacity_bytes=t.capacity_bytes, num_chunks=t.num_chunks,
        num_bytes=t.num_bytes, num_evicted_chunks=t.num_evicted_chunks,
        num_dropped_chunks=t.num_dropped_chunks) for t in stats.tiers]
    return kvcache_pb2.StoreStats(
        chunk_tokens=stats.chunk_tokens, num_hit_tokens=stats.num_hit_tokens,
        num_miss_tokens=stats.num_miss_tokens, num_stored_chunks=stats.num_stored_chunks,
        num_stored_tokens=stats.num_stored_tokens, num_stored_bytes=stats.num_stored_bytes,
        num_skipped_tokens=stats.num_skipped_tokens, num_loaded_chunks=stats.num_loaded_chunks,
        num_loaded_tokens=stats.num_loaded_tokens, num_loaded_bytes=stats.num_loaded_bytes,
        num_load_miss_tokens=stats.num_load_miss_tokens, tiers=tiers)
