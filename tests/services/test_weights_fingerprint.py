"""The weights' fingerprint in the KV store's chunk keys: the same bytes give the same name,
other weights under the same path (a swap) another one, so stored KV never crosses weights."""

import shutil
from pathlib import Path

import pytest
import torch

from kvcache_svc.kv_store.memory_tier import MemoryTier
from kvcache_svc.kv_store.store import KvStore
from services import weights_fingerprint
from services.kv_chunks import make_chunk
from services.model_config import load_model_config
from services.weights_fingerprint import weights_fingerprint as fingerprint
from services.weights_fingerprint import weights_model_name
from worker_svc.runner import ModelRunner


def test_same_bytes_same_fingerprint_other_bytes_another(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 1000)
    first = fingerprint(path)
    assert fingerprint(path) == first
    (tmp_path / "copy.gguf").write_bytes(path.read_bytes())
    assert fingerprint(tmp_path / "copy.gguf") == first      # not the path: the bytes
    data = bytearray(path.read_bytes())
    data[123_456] ^= 1
    path.write_bytes(bytes(data))                             # same name, same size
    assert fingerprint(path) != first
    name = weights_model_name("model", path)
    assert name.startswith("model@") and len(name) <= 256
    assert len(weights_model_name("m" * 300, path)) == 256


def test_large_files_are_sampled_at_both_ends(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_fingerprint, "FULL_HASH_BYTES", 1 << 16)
    monkeypatch.setattr(weights_fingerprint, "EDGE_BYTES", 1 << 12)
    path = tmp_path / "big.gguf"
    path.write_bytes(bytes(1 << 20))
    first = fingerprint(path)
    for offset in (10, (1 << 20) - 10):                       # the header, the tail
        data = bytearray(path.read_bytes())
        data[offset] = 7
        path.write_bytes(bytes(data))
        assert fingerprint(path) != first
        first = fingerprint(path)


def test_a_directory_hashes_its_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 100)
    (tmp_path / "README.md").write_text("not weights")
    first = fingerprint(tmp_path)
    (tmp_path / "README.md").write_text("edited")
    assert fingerprint(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"b" * 100)
    assert fingerprint(tmp_path) != first


def test_runner_slice_names_the_weights_not_the_file(tmp_path: Path, model_path: Path) -> None:
    """Weights swapped under the same path (a restart of the worker): the new runner's chunk
    keys differ from the old one's, so the store serves it nothing the old weights computed."""
    model_config = load_model_config(model_path)
    path = tmp_path / model_path.name
    shutil.copyfile(model_path, path)
    before = ModelRunner(model_config, path, torch.float32, "w").kv_slice()
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x10                                       # one weight byte, same size
    path.write_bytes(bytes(data))
    after = ModelRunner(model_config, path, torch.float32, "w").kv_slice()
    assert before.model.startswith(model_config.name + "@")
    assert after.model != before.model
    store = KvStore([MemoryTier(1 << 20)], chunk_tokens=16)
    assert store.put(*_chunk(before.key(bytes(32), 16)))
    assert store.lookup([before.key(bytes(32), 16)]) == 1
    assert store.lookup([after.key(bytes(32), 16)]) == 0      # no hit across the swap


def _chunk(key):  # type: ignore[no-untyped-def]
    chunk = make_chunk(key, (1, 2, 16, 1, 1), bytes(4 * 32))
    return chunk.header, chunk.data
