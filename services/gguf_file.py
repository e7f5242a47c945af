"""A GGUF file's metadata and tensor table, read in one pass (model config, tokenizer, weights).

Why not `gguf.GGUFReader`: it builds a numpy view per array element, so the default model's
tokenizer arrays (49,152 tokens, 48,900 merges) took 3-4 s to parse on every open, and a worker
opened the file twice (config, then weights): about 7 of its 9 s of start-up. This reads the
same layout with `struct` and `numpy.frombuffer` in about 0.1 s. The tensors stay in a memory
map; `gguf.quants` still dequantizes them.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, field count
u64; the fields (key string, value type u32, value); the tensor infos (name, dims u32 + u64
each, type u32, offset u64); then the tensor data, aligned to `general.alignment` (32). A
string is a u64 length and UTF-8 bytes. Every count, length and offset is checked against the
file's size before it is used, so a truncated or corrupt file is a `GgufError`, not a crash
or a huge allocation.
"""

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) of the scalar types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """Not a GGUF file this reader understands, or a corrupt one."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    type_id: int             # ggml type (gguf.GGMLQuantizationType)
    dims: tuple[int, ...]    # ggml order: dims[0] varies fastest
    data: np.ndarray         # as gguf.GGUFReader gives it: rows of the last dimension;
                             # float types typed, block-quantized ones raw uint8 bytes

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id).name


class GgufFile:
    """`fields`: key -> value (int, float, bool, str, list of str, or a numpy array for numeric
    arrays); `tensors` in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._mem = memoryview(self._buf)
        self._pos = 0
        if bytes(self._take(4)) != MAGIC:
            raise GgufError(f"{self.path}: not a GGUF file")
        version = self._scalar(4)
        if version not in (2, 3):
            raise GgufError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, object] = {}
        for _ in range(self._count(num_fields, 12)):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(self._count(num_tensors, 24)):
            name = self._string()
            num_dims = self._scalar(4)
            if not 0 < num_dims <= 4:
                raise GgufError(f"{self.path}: tensor {name!r} has {num_dims} dimensions")
            dims = tuple(self._scalar(10) for _ in range(num_dims))
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GgufError(f"{self.path}: bad general.alignment {alignment!r}")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    # ---------------------------------------------------------------- primitive reads

    def _take(self, size: int) -> memoryview:
        end = self._pos + size
        if size < 0 or end > len(self._mem):
            raise GgufError(f"{self.path}: truncated at byte {self._pos} (wanted {size} more)")
        view = self._mem[self._pos:end]
        self._pos = end
        return view

    def _scalar(self, value_type: int) -> object:
        fmt = _SCALARS[value_type][0]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _count(self, count: object, min_bytes_each: int) -> int:
        """A count read from the file, refused if its items could not fit in what is left."""
        assert isinstance(count, int)
        if count * min_bytes_each > len(self._mem) - self._pos:
            raise GgufError(f"{self.path}: a count of {count} does not fit the file")
        return count

    def _string(self) -> str:
        length = self._scalar(10)
        assert isinstance(length, int)
        try:
            return bytes(self._take(length)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufError(f"{self.path}: a string is not UTF-8 at byte {self._pos}") from exc

    def _value(self, value_type: object) -> object:
        if value_type in _SCALARS:
            return self._scalar(value_type)  # type: ignore[arg-type]
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise GgufError(f"{self.path}: unknown value type {value_type} at byte {self._pos}")
        item_type, count = self._scalar(4), self._scalar(10)
        if item_type == _STRING:
            return [self._string() for _ in range(self._count(count, 8))]
        if item_type not in _SCALARS:
            raise GgufError(f"{self.path}: unsupported array item type {item_type}")
        dtype = np.dtype(_SCALARS[item_type][1])  # type: ignore[index]
        raw = self._take(self._count(count, dtype.itemsize) * dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype).copy()

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], type_id: int,
                offset: int) -> GgufTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GgufError(f"{self.path}: tensor {name!r} has unknown type {type_id}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GgufError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole "
                            f"blocks of {block}")
        row_bytes = dims[0] // block * block_bytes
        num_rows = int(np.prod(dims[1:], dtype=np.int64))
        begin, size = start + offset, row_bytes * num_rows
        if begin + size > len(self._buf):
            raise GgufError(f"{self.path}: tensor {name!r} lies past the end of the file")
        raw = self._buf[begin:begin + size]
        shape = tuple(reversed(dims[1:]))
        typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}.get(qtype)
        if typed is not None:
            data = raw.view(typed).reshape(*shape, dims[0])
        else:
            data = raw.reshape(*shape, row_bytes)
        return GgufTensor(name, type_id, dims, data)
