"""`StoreView`: what the KV store holds for one replica, asked at admission (issue 15).

A replica's KV is split over its ranks (pipeline stages by layers, tensor-parallel ranks by KV
heads), and each rank saves and loads its own slice. A chunk is usable by the replica only when
the store holds it for every slice, and only after every chunk before it (`services.kv_chunks`
keys a chunk by the chained hash of its last block). The view turns a request's block hashes
into each slice's chunk keys and answers in blocks or tokens, so the block manager can plan a
load: whole chunks, or (`num_held_tokens`) the request's every token when the store also holds
its last chunk, partial or not, keyed by the hash of the request's exact tokens.
"""

from collections.abc import Sequence

from kvcache_svc.kv_store.store import KvStore
from services.kv_chunks import chunk_keys
from services.kv_store_wire import ChunkKey, KvSlice


class StoreView:
    def __init__(self, store: KvStore, slices: Sequence[KvSlice], block_size: int) -> None:
        """Raises ValueError when the store's chunks are no whole number of blocks."""
        if not slices:
            raise ValueError("a store view needs at least one slice")
        if store.chunk_tokens % block_size:
            raise ValueError(f"the KV store's chunks of {store.chunk_tokens} tokens are no "
                             f"multiple of the block size {block_size}")
        self.store = store
        self.slices = tuple(slices)
        self.block_size = block_size
        self.blocks_per_chunk = store.chunk_tokens // block_size
        self.last_lookup = (0, 0)       # (hit, miss) tokens of the last num_held_blocks

    def num_held_blocks(self, block_hashes: Sequence[bytes], num_cached_blocks: int = 0) -> int:
        """Leading blocks of `block_hashes` whose KV the store holds for every slice, counting
        on from the chunk holding block `num_cached_blocks` (blocks before it are the
        replica's own prefix hit: the store need not hold those), in whole chunks; 0 when it
        holds nothing past them. Counts nothing: an admission that goes ahead calls
        `count_last_lookup` (one that does not fit is asked again, and must not count twice;
        routing queries never count)."""
        first_chunk = num_cached_blocks // self.blocks_per_chunk
        key_lists = [chunk_keys(block_hashes, self.block_size, self.store.chunk_tokens,
                                kv_slice)[first_chunk:] for kv_slice in self.slices]
        self.last_lookup = (0, 0)
        if not key_lists[0]:
            return 0
        num_chunks = min(self.store.lookup_many(key_lists, record=False))
        chunk_tokens = self.store.chunk_tokens
        self.last_lookup = (num_chunks * chunk_tokens,
                            (len(key_lists[0]) - num_chunks) * chunk_tokens)
        if num_chunks == 0:
            return 0
        return (first_chunk + num_chunks) * self.blocks_per_chunk

    def num_held_tokens(self, block_hashes: Sequence[bytes], num_tokens: int,
                        tail_hash: bytes | None, num_cached_blocks: int = 0) -> int:
        """Leading tokens of a request of `num_tokens` tokens whose KV the store holds for
        every slice, past its prefix hit (`num_cached_blocks`): whole chunks, or all
        `num_tokens` when it also holds the last chunk up to the request's end (keyed by
        `tail_hash` when the last block is partial, else by the last block's hash). 0 when it
        holds nothing past the hit. Counts nothing (see `num_held_blocks`)."""
        chunk_tokens = self.store.chunk_tokens
        first_chunk = num_cached_blocks // self.blocks_per_chunk
        window = num_tokens // chunk_tokens * chunk_tokens
        if num_tokens % self.block_size:
            end_hash = tail_hash
        else:
            end_hash = block_hashes[num_tokens // self.block_size - 1] if (
                len(block_hashes) >= num_tokens // self.block_size) else None
        if end_hash is None or window == num_tokens or window < first_chunk * chunk_tokens:
            return self.num_held_blocks(block_hashes, num_cached_blocks) * self.block_size
        full = [chunk_keys(block_hashes[:window // self.block_size], self.block_size,
                           chunk_tokens, kv_slice)[first_chunk:] for kv_slice in self.slices]
        key_lists: list[list[ChunkKey]] = [
            keys + [kv_slice.key(end_hash, num_tokens - window)]
            for keys, kv_slice in zip(full, self.slices)]
        num_chunks = min(self.store.lookup_many(key_lists, record=False))
        hit = sum(key.num_tokens for key in key_lists[0][:num_chunks])
        self.last_lookup = (hit, sum(key.num_tokens for key in key_lists[0][num_chunks:]))
        if num_chunks == len(key_lists[0]):
            return num_tokens
        return (first_chunk + num_chunks) * chunk_tokens if num_chunks else 0

    def count_last_lookup(self) -> None:
        """Counts the last `num_held_blocks` in the store's hit and miss tokens, once."""
        self.store.count_lookup(*self.last_lookup)
        self.last_lookup = (0, 0)
