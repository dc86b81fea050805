"""The tensor directory of a .gguf file, read without parsing its metadata arrays.

gguf's `GGUFReader` turns every metadata value into numpy views; a file that
carries its tokenizer (a vocabulary and merges: ~100,000 strings) takes seconds
that way, at every start of a worker running the file's layers quantized. Those
need only the tensors and a few scalar values, so this walks the same layout
(GGUF v2/v3, little-endian), stepping over arrays by their lengths, and maps
each tensor's data as GGUFReader does (quantized types as [rows, bytes a row]
uint8). A big-endian file goes through GGUFReader itself.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

V = GGUFValueType
SCALARS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
PLAIN_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
               GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
               GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
               GGMLQuantizationType.I64: np.int64}
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (innermost first), `data` mapped from the file."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFDirectory:
    metadata: dict[str, Any]  # the scalar values (strings and numbers); arrays are skipped
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.offset = buffer, 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self.offset += length
        return bytes(self.buffer[self.offset - length:self.offset]).decode("utf-8")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.offset += 8 + struct.unpack_from("<Q", self.buffer, self.offset)[0]

    def value(self, kind: int) -> Any:
        """A value of GGUF type `kind`; None for an array, which is stepped over."""
        kind = V(kind)
        if kind == V.STRING:
            return self.string()
        if kind != V.ARRAY:
            return self.scalar(SCALARS[kind])
        item, count = V(self.scalar("<I")), self.scalar("<Q")
        if item == V.STRING:
            self.skip_strings(count)
        elif item == V.ARRAY:
            for _ in range(count):
                self.value(V.ARRAY)
        else:
            self.offset += count * struct.calcsize(SCALARS[item])
        return None


def read_gguf_directory(path: str) -> GGUFDirectory:
    """The scalar metadata and the tensors of the .gguf file at `path`."""
    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(cursor.buffer[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.offset = 4
    version = cursor.scalar("<I")
    if version & 0xFFFF == 0:  # written for the other byte order
        return _through_gguf_reader(path)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        value = cursor.value(cursor.scalar("<I"))
        if value is not None:
            metadata[key] = value
    entries = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        entries.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = (cursor.offset + alignment - 1) // alignment * alignment
    tensors = {}
    for name, dims, kind, offset in entries:
        count = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        if kind in PLAIN_TYPES:
            dtype, items = PLAIN_TYPES[kind], count
        else:
            dtype, items, shape = np.uint8, count * size // block, quant_shape_to_byte_shape(shape, kind)
        begin = start + offset
        array = data[begin:begin + items * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
        tensors[name] = GGUFTensor(name, kind, dims, array)
    return GGUFDirectory(metadata, tensors)


def _through_gguf_reader(path: str) -> GGUFDirectory:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()  # less its "GGUF.*" pseudo-fields
                if field.types and field.types[0] != V.ARRAY and not key.startswith("GGUF.")}
    tensors = {t.name: GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data)
               for t in reader.tensors}
    return GGUFDirectory(metadata, tensors)
