"""KV store chunks from and to torch tensors, for the worker.

A chunk's data is a contiguous CPU tensor's bytes, taken without a copy (the device-to-host copy
is the worker's business, so that it can overlap its steps). A loaded chunk becomes a tensor
over the received frame, again without a copy; the worker copies it into its paged cache.
"""

import logging
from collections.abc import Sequence

import torch

from services.kv_chunks import KvChunk, make_chunk
from services.kv_store_client import KvStoreClient, SaveResult
from services.kv_store_wire import KV_DTYPE_BYTES, ChunkKey

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_BYTES}


def chunk_from_tensor(key: ChunkKey, tensor: torch.Tensor) -> KvChunk:
    """`tensor`'s bytes as the chunk `key` (shape kept; the layout is the worker's own). The
    chunk shares the tensor's memory when it is contiguous: do not write it while saving."""
    if tensor.device.type != "cpu":
        raise ValueError(f"a chunk is saved from host memory, got a tensor on {tensor.device}")
    if tensor.dtype != TORCH_DTYPES[key.dtype]:
        raise ValueError(f"tensor of {tensor.dtype} for a chunk of {key.dtype}")
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return make_chunk(key, tuple(tensor.shape), flat.numpy().data)


def tensor_from_chunk(chunk: KvChunk) -> torch.Tensor:
    """The chunk's data as a tensor of its shape and dtype (sharing the data's memory when it
    is writable, else a copy)."""
    data = memoryview(chunk.data)
    if data.readonly:
        data = memoryview(bytearray(data))
    flat = torch.frombuffer(data, dtype=TORCH_DTYPES[chunk.key.dtype])
    return flat.reshape(chunk.header.shape)


def save_tensors(client: KvStoreClient,
                 chunks: Sequence[tuple[ChunkKey, torch.Tensor]]) -> SaveResult:
    """Saves `(key, tensor)` chunks; tensors must stay unwritten until this returns."""
    return client.save([chunk_from_tensor(key, tensor) for key, tensor in chunks])


def load_tensors(client: KvStoreClient, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
    """Per key, its tensor or None (a miss: recompute those tokens)."""
    return [None if chunk is None else tensor_from_chunk(chunk) for chunk in client.load(keys)]
