"""A GGUF file's container: header, metadata and tensor table, with each tensor's bytes a numpy
view of one read-only memory map (nothing is copied until a tensor is dequantized).

gguf.GGUFReader gives the same tensors but builds two numpy views for every element of every
metadata array: a 49k-token vocabulary with its merges took 3.5-7 s to open, most of an
engine's start-up. Here numeric arrays are one np.frombuffer each and strings one struct read
each (tens of milliseconds); the type tables are the gguf package's own (GGUFValueType,
GGMLQuantizationType, GGML_QUANT_SIZES), and tensors have GGUFReader's shapes: the float and
integer types as their elements, every other type as uint8 rows of blocks.

Versions 2 and 3, little-endian (what llama.cpp and the gguf package write).
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}  # fmt: skip
# Tensor types stored as plain elements; every other type is blocks of bytes.
_ELEMENTS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, fastest-varying first (ggml's ne)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # numpy's order (shape reversed), uint8 rows of blocks if quantized


class _Cursor:
    """Little-endian reads from a buffer, each checked against its end (a truncated file raises
    ValueError, never reads past the map)."""

    def __init__(self, buf, offset: int = 0):
        self.buf, self.offset, self.size = buf, offset, len(buf)

    def take(self, n: int) -> int:
        start = self.offset
        if n < 0 or start + n > self.size:
            raise ValueError(f"the file ends at byte {self.size}, {start + n} expected")
        self.offset = start + n
        return start

    def unpack(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def u64(self) -> int:
        return self.unpack("<Q")[0]

    def raw(self, n: int) -> bytes:
        start = self.take(n)
        return bytes(self.buf[start : start + n])

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges: ~100k of them), in one local
        loop: a quarter of the time of a call per string."""
        buf, offset, size = self.buf, self.offset, self.size
        length = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            (n,) = length(buf, offset)
            end = offset + 8 + n
            if end > size:
                raise ValueError(f"the file ends at byte {size}, {end} expected")
            out.append(str(buf[offset + 8 : end], "utf-8"))
            offset = end
        self.offset = offset
        return out

    def value(self, kind: GGUFValueType):
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.u32()), self.u64()
            if item == GGUFValueType.STRING:
                return self.strings(count)
            if item == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item]).newbyteorder("<")
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        dtype = np.dtype(_SCALARS[kind]).newbyteorder("<")
        start = self.take(dtype.itemsize)
        return np.frombuffer(self.buf, dtype, 1, start).tolist()[0]


class GGUFFile:
    """`metadata`: every key's value as Python values (strings, numbers, lists); `tensors`: in
    the file's order; `data_offset`: where the tensor data starts."""

    def __init__(self, path: str | os.PathLike):
        self._path = os.fspath(path)
        # A memoryview of the map: slicing the memmap itself costs a numpy object per string.
        cur = _Cursor(memoryview(np.memmap(path, mode="r")))
        if cur.raw(4) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = cur.u32()
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file: not supported")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
        num_tensors, num_keys = cur.u64(), cur.u64()
        self.metadata: dict = {}
        for _ in range(num_keys):
            key = cur.string()
            self.metadata[key] = cur.value(GGUFValueType(cur.u32()))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            dims = cur.unpack(f"<{cur.u32()}Q")
            infos.append((name, dims, GGMLQuantizationType(cur.u32()), cur.u64()))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-cur.offset // alignment) * alignment
        self.tensors = [self._tensor(cur.buf, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def read(self, tensor: GGUFTensor, index: int | None = None) -> np.ndarray:
        """A copy of the tensor's data (its `data`'s shape and dtype), or of `data[index]`
        alone (one expert of a stacked tensor), read with pread rather than through the map:
        page-cache copies at memory speed instead of a fault per page (an 8B model's 4.4 GB of
        codes: 3.5 s of faults through the map), and none of the map's pages left resident
        beside the copy (read through the map, an 8B load peaked at twice the file)."""
        shape, start, n_bytes = tensor.data.shape, tensor.data_offset, tensor.n_bytes
        if index is not None:
            if not 0 <= index < shape[0]:
                raise IndexError(f"tensor {tensor.name}: no index {index} in {shape[0]}")
            shape, n_bytes = shape[1:], n_bytes // shape[0]
            start += index * n_bytes
        out = np.empty(shape, tensor.data.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self._path, os.O_RDONLY)
        try:
            done = 0
            while done < n_bytes:  # pread may return less than asked
                n = os.preadv(fd, [view[done:]], start + done)
                if n <= 0:
                    raise ValueError(f"tensor {tensor.name}: the file ends before its data")
                done += n
        finally:
            os.close(fd)
        return out

    def _tensor(self, buf, name, dims, ggml_type, offset) -> GGUFTensor:
        n_elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + offset
        if start + n_bytes > len(buf):
            raise ValueError(f"tensor {name} ends at byte {start + n_bytes}, past the file's end")
        shape = tuple(reversed(dims))
        if ggml_type in _ELEMENTS:
            dtype = np.dtype(_ELEMENTS[ggml_type]).newbyteorder("<")
            data = np.frombuffer(buf, dtype, n_elements, start)
        else:
            data = np.frombuffer(buf, np.uint8, n_bytes, start)
            shape = quant_shape_to_byte_shape(shape, ggml_type)
        return GGUFTensor(name, ggml_type, tuple(dims), n_elements, n_bytes, start,
                          data.reshape(shape))  # fmt: skip
