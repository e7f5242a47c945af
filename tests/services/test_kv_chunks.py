"""Chunk boundaries and keys, the data checks, and the worker's "stored KV" line."""

import logging

import msgspec
import pytest

from services import cluster_token
from services.block_hash import hash_block, hash_full_blocks
from services.codec import Codec, DecodeError
from services.kv_chunks import (
    KvSlice,
    chunk_checksum,
    chunk_keys,
    chunk_problem,
    chunk_token_ends,
    extend_chunk,
    extension_problem,
    layer_range,
    log_stored,
    make_chunk,
    prefix_chunk_keys,
    prefix_hash,
    skip_leading_tokens,
    window_ends,
)
from services.kv_store_wire import KV_DTYPE_BYTES, ChunkKey, KvDtype, LookupChunks, ToKvStore

SLICE = KvSlice("m", "bfloat16", layer_start=4, layer_end=8, head_start=2, head_end=4)


def test_chunks_end_every_chunk_tokens_over_full_blocks() -> None:
    assert chunk_token_ends(10, block_size=16, chunk_tokens=64) == [64, 128]
    assert chunk_token_ends(3, 16, 64) == []
    for chunk_tokens in (0, 8, 24):
        with pytest.raises(ValueError, match="multiple of block_size"):
            chunk_token_ends(10, 16, chunk_tokens)


def test_a_chunk_is_keyed_by_its_last_blocks_hash_and_the_ranks_slice() -> None:
    hashes = hash_full_blocks(list(range(100)), block_size=4)         # 25 blocks
    keys = chunk_keys(hashes, block_size=4, chunk_tokens=32, kv_slice=SLICE)
    assert [(k.block_hash, k.num_tokens) for k in keys] == [(hashes[7], 32), (hashes[15], 32),
                                                            (hashes[23], 32)]
    assert all((k.model, k.dtype, k.layer_start, k.layer_end, k.head_start, k.head_end)
               == ("m", "bfloat16", 4, 8, 2, 4) for k in keys)
    longer = chunk_keys(hash_full_blocks(list(range(200)), 4), 4, 32, SLICE)
    assert longer[:3] == keys
    other_rank = KvSlice("m", "bfloat16", 4, 8, 0, 2)
    assert chunk_keys(hashes, 4, 32, other_rank)[0] != keys[0]


def test_skip_leading_tokens_and_the_stored_line(caplog: pytest.LogCaptureFixture) -> None:
    tokens = list(range(100))
    keys = prefix_chunk_keys(hash_full_blocks(tokens, 4), tokens, 0, 100, 4, 32, SLICE)
    assert skip_leading_tokens(keys, 0) == 0
    assert skip_leading_tokens(keys, 2) == 64 and skip_leading_tokens(keys, 4) == 100
    with caplog.at_level(logging.INFO):
        log_stored(logging.getLogger("worker"), 36, 100, 64)
    assert "stored KV for 36 of 100 tokens (skip_leading_tokens=64)" in caplog.text


def test_make_chunk_and_chunk_problem() -> None:
    key = SLICE.key(bytes(32), 16)
    chunk = make_chunk(key, (2, 3), bytes(range(12)))
    assert chunk.num_bytes == 12 and chunk_problem(chunk.header, chunk.data) is None
    assert "data of 11 bytes" in (chunk_problem(chunk.header, bytes(range(11))) or "")
    assert chunk_problem(chunk.header, bytes(range(1, 13))) == "checksum mismatch"
    with pytest.raises(ValueError, match="11 bytes of data"):
        make_chunk(key, (2, 3), bytes(11))
    with pytest.raises(ValueError, match="at least one dimension"):
        make_chunk(key, (), b"")
    with pytest.raises(ValueError, match="at least one dimension"):
        make_chunk(key, (0, 3), b"")


def test_each_layer_is_checked_on_its_own_and_a_range_is_a_chunk() -> None:
    """Checksums per slice of the first dimension (a layer): a range of layers is served with
    its own checksums, nothing hashed again, and checks as a chunk of its own."""
    key = SLICE.key(bytes(32), 16)
    data = bytes(range(24))
    chunk = make_chunk(key, (3, 2, 2), data)                 # 3 layers of 8 bytes
    assert chunk.header.slice_checksums == tuple(
        chunk_checksum(data[i * 8:(i + 1) * 8]) for i in range(3))
    part = layer_range(chunk, 1, 3)
    assert part is not None and part.header.shape == (2, 2, 2) and part.key == key
    assert bytes(part.data) == data[8:] and chunk_problem(part.header, part.data) is None
    assert layer_range(chunk, 0, 3) is chunk and layer_range(chunk, 2, 4) is None
    flipped = bytearray(part.data)
    flipped[9] ^= 1                                          # in the range's second layer
    assert chunk_problem(part.header, bytes(flipped)) == "checksum mismatch"
    sums = part.header.slice_checksums
    swapped = msgspec.structs.replace(part.header, slice_checksums=sums[::-1])
    assert chunk_problem(swapped, part.data) == "checksum mismatch"     # the root no longer fits
    short = msgspec.structs.replace(part.header, slice_checksums=sums[:1])
    assert "1 slice checksums for a first dimension of 2" in (
        chunk_problem(short, part.data) or "")
    with pytest.raises(ValueError, match="at most 1024"):
        make_chunk(key, (1025, 1), bytes(2050))


def test_the_dtype_list_and_its_sizes_agree() -> None:
    assert set(KvDtype.__args__) == set(KV_DTYPE_BYTES)  # type: ignore[attr-defined]


def test_keys_are_validated_when_decoded_and_built() -> None:
    codec: Codec[ToKvStore] = Codec(ToKvStore, key=b"k" * 32)
    good = SLICE.key(bytes(32), 16)
    assert codec.decode(codec.encode(LookupChunks([[good]]))) == LookupChunks([[good]])
    fields = ["ChunkKey", bytes(32), 16, "m", "bfloat16", 4, 8, 2, 4]
    for index, value in [(6, 4),               # empty layer range
                         (7, 4),               # empty head range
                         (4, "int4"),          # not an allowed dtype
                         (1, bytes(31)),       # not a SHA-256 hash
                         (2, 0)]:              # no tokens
        bad = [*fields[:index], value, *fields[index + 1:]]
        payload = msgspec.msgpack.encode(["LookupChunks", [[bad]]])
        with pytest.raises(DecodeError):
            codec.decode(payload + cluster_token.frame_tag(b"k" * 32, payload))
    with pytest.raises(ValueError, match="empty slice"):
        KvSlice("m", "bfloat16", 4, 4, 0, 1).key(bytes(32), 16)
    assert isinstance(good, ChunkKey) and hash(good) == hash(SLICE.key(bytes(32), 16))


def test_a_partial_chunk_is_keyed_by_its_exact_token_prefix() -> None:
    """The seeds' 32 tokens: a chunk ending inside a block hashes that block's tokens so far
    onto the chain; it differs from every full block's hash and from any other prefix's."""
    tokens = list(range(100, 132))
    hashes = hash_full_blocks(tokens, 16, cache_salt=b"s")
    assert prefix_hash(hashes, tokens, 32, 16, b"s") == hashes[1]
    at_24 = prefix_hash(hashes, tokens, 24, 16, b"s")
    assert at_24 == hash_block(hashes[0], tokens[16:24])
    assert at_24 not in hashes and prefix_hash(hashes, tokens, 23, 16, b"s") != at_24
    assert prefix_hash(hashes, tokens, 8, 16, b"s") == hash_block(bytes(32), tokens[:8], b"s")
    assert prefix_hash(hashes, tokens, 8, 16) != prefix_hash(hashes, tokens, 8, 16, b"s")
    assert window_ends(24, 32, 256) == [(0, 32)]
    assert window_ends(200, 600, 256) == [(0, 256), (256, 512), (512, 600)]
    keys = prefix_chunk_keys(hashes, tokens, 0, 24, 16, 256, SLICE, b"s")
    assert [(k.block_hash, k.num_tokens) for k in keys] == [(at_24, 24)]
    longer = list(range(100, 400))
    keys = prefix_chunk_keys(hash_full_blocks(longer, 16), longer, 100, 300, 16, 256, SLICE)
    assert [k.num_tokens for k in keys] == [256, 44]
    assert keys[0] == chunk_keys(hash_full_blocks(longer, 16), 16, 256, SLICE)[0]


def test_an_extension_appends_its_tokens_to_its_base() -> None:
    """Shape [layers, 2, tokens, heads, dim]: each (layer, k/v) row gets the new tokens."""
    one_byte = KvSlice("m", "float8_e4m3fn", 4, 8, 2, 4)     # one byte per element
    base_key, key = one_byte.key(bytes(32), 3), one_byte.key(b"\x01" * 32, 5)
    base = make_chunk(base_key, (2, 2, 3, 1, 1), bytes([10, 11, 12, 20, 21, 22, 30, 31, 32,
                                                          40, 41, 42]))
    new = make_chunk(key, (2, 2, 2, 1, 1), bytes([13, 14, 23, 24, 33, 34, 43, 44]),
                     base=base_key)
    assert extension_problem(new.header) is None
    whole = extend_chunk(base, new.header, new.data)
    assert whole.key == key and whole.header.shape == (2, 2, 5, 1, 1)
    assert whole.header.base is None
    assert bytes(whole.data) == bytes([10, 11, 12, 13, 14, 20, 21, 22, 23, 24,
                                       30, 31, 32, 33, 34, 40, 41, 42, 43, 44])
    assert chunk_problem(whole.header, whole.data) is None
    wrong = make_chunk(key, (2, 2, 3, 1, 1), bytes(12), base=base_key)
    assert "no [layers, 2, 2 tokens" in (extension_problem(wrong.header) or "")
    other = make_chunk(key, (2, 2, 2, 1, 1), bytes(8),
                       base=KvSlice("m2", "float8_e4m3fn", 4, 8, 2, 4).key(bytes(32), 3))
    assert "another slice" in (extension_problem(other.header) or "")
