"""services/gguf_file.py: the same fields and tensors as gguf's own reader, and a corrupt
file refused with a GgufError rather than a crash or a huge allocation."""

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from services.gguf_file import GgufError, GgufFile


def test_reads_what_gguf_reader_reads(model_path: Path) -> None:
    ours, theirs = GgufFile(model_path), GGUFReader(model_path)
    their_fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.fields) == set(their_fields)
    for key, field in their_fields.items():
        expected, got = field.contents(), ours.fields[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, theirs_t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type_id == int(theirs_t.tensor_type), mine.name
        assert mine.dims == tuple(int(d) for d in theirs_t.shape), mine.name
        assert mine.data.dtype == theirs_t.data.dtype, mine.name
        assert mine.data.shape == theirs_t.data.shape, mine.name
        assert np.array_equal(mine.data, theirs_t.data), mine.name


def _header(num_tensors: int, num_fields: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, num_tensors, num_fields)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


@pytest.mark.parametrize("content, message", [
    (b"GGML" + bytes(20), "not a GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 7, 0, 0), "version 7"),
    (_header(0, 1), "does not fit"),
    (_header(0, 1) + struct.pack("<Q", 40) + b"ab" + bytes(10), "truncated"),
    (_header(0, 2**40), "does not fit"),
    (_header(0, 1) + _string("k") + struct.pack("<I", 99), "unknown value type 99"),
    (_header(0, 1) + _string("k") + struct.pack("<IIQ", 9, 4, 2**50), "does not fit"),
    (_header(0, 1) + struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<II", 4, 1), "UTF-8"),
    (_header(1, 0) + _string("w") + struct.pack("<IQQIQ", 2, 64, 4, 0, 0), "past the end"),
    (_header(1, 0) + _string("w") + struct.pack("<IQIQ", 1, 33, 2, 0), "whole blocks"),
])
def test_corrupt_files_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=message):
        GgufFile(path)


def test_a_small_file_round_trips(tmp_path: Path) -> None:
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    head = (_header(1, 2)
            + _string("general.architecture") + struct.pack("<I", 8) + _string("llama")
            + _string("xs") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", -1, 0, 7)
            + _string("w") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0))
    path = tmp_path / "small.gguf"
    path.write_bytes(head + bytes(-len(head) % 32) + values.tobytes())
    gguf = GgufFile(path)
    assert gguf.fields["general.architecture"] == "llama"
    assert gguf.fields["xs"].tolist() == [-1, 0, 7]  # type: ignore[attr-defined]
    (tensor,) = gguf.tensors
    assert tensor.name == "w" and tensor.dims == (4, 2) and tensor.type_name == "F32"
    assert np.array_equal(tensor.data, values)
