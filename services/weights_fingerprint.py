"""A cheap fingerprint of a model's weights, for the KV store's chunk keys (issue 24, point 4).

The store's disk tier outlives kvcache_svc and the workers, so a chunk key that named the model
by its file name only would let a model swapped under the same path (other weights) be served
KV its predecessor computed. The worker computes this once per model file it loads and puts it
into its `KvSlice.model` (`weights_model_name`); keys from other weights never match.

Cheap: a file up to FULL_HASH_BYTES is hashed whole; a larger one by its size, its first and
last MiB (a GGUF's header and tensor index, a safetensors header) and SAMPLES evenly spaced
pieces, so a multi-GiB checkpoint costs a few MiB of reads. A directory (Hugging Face layout)
hashes its weight and config files, each the same way, in name order.
"""

import os
from pathlib import Path

import blake3

FULL_HASH_BYTES = 256 << 20     # files up to this are hashed whole
EDGE_BYTES = 1 << 20            # read at each end of a larger file
SAMPLES = 64                    # pieces read in between
SAMPLE_BYTES = 64 << 10
FINGERPRINT_HEX = 16            # characters kept (64 bits: enough to tell weights apart)
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")


def file_fingerprint(path: Path, digest: blake3.blake3) -> None:
    """Feeds `path`'s size and contents (whole or sampled, see the module doc) to `digest`."""
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with path.open("rb") as file:
        if size <= FULL_HASH_BYTES:
            while block := file.read(8 << 20):
                digest.update(block)
            return
        offsets = [0, size - EDGE_BYTES]
        step = (size - 2 * EDGE_BYTES) // (SAMPLES + 1)
        offsets += [EDGE_BYTES + step * (i + 1) for i in range(SAMPLES)]
        for offset in offsets:
            file.seek(offset)
            digest.update(file.read(EDGE_BYTES if offset in offsets[:2] else SAMPLE_BYTES))


def weights_fingerprint(model_path: str | os.PathLike[str]) -> str:
    """The fingerprint (hex) of the weights at `model_path`: a file, or a directory whose
    weight and config files are hashed in name order. Raises OSError when unreadable."""
    path = Path(model_path)
    digest = blake3.blake3()   # the default 98 MB GGUF, whole and cached: ~50 ms (BLAKE2b ~165)
    if path.is_dir():
        for each in sorted(p for p in path.iterdir()
                           if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
            digest.update(each.name.encode())
            file_fingerprint(each, digest)
    else:
        file_fingerprint(path, digest)
    return digest.hexdigest(FINGERPRINT_HEX // 2)


def weights_model_name(name: str, model_path: str | os.PathLike[str]) -> str:
    """`name@fingerprint`: what a rank's `KvSlice.model` holds (at most 256 characters)."""
    return f"{name[:256 - FINGERPRINT_HEX - 1]}@{weights_fingerprint(model_path)}"
