"""A GGUF file's metadata and tensor table, read in one pass over its header. The gguf package's
GGUFReader builds a numpy view per array element: seconds for Gemma 3's 262k-token vocabulary (three
arrays of it), paid by the server (tokenizer), the launcher (memory plan) and each agent (weights).
Here arrays of numbers are one `frombuffer` each and strings a plain loop (docs/perf-notes.md)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# value type -> struct format (a scalar) and numpy dtype (an array of them)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAYS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}  # stored as values; every other type as bytes, [rows, bytes a row]


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # in the file
    n_bytes: int
    data: np.ndarray  # as GGUFReader gives it (what gguf.quants.dequantize takes); read-only, on the file's map


class GgufFile:
    """`meta`: every key's value (numbers, strings, lists); `tensors`: the tensor table, in file order."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", self._map, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{self.path.name}: not a GGUF file of version 2 or 3")
        self._pos = 24
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.meta.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]

    def drop_pages(self, t: GgufTensor) -> None:
        """Unmap a tensor's file pages from this process once read: mapped file pages count in its RSS
        (they stay in the page cache), and a whole model's would make loading peak at twice its size."""
        start = t.data_offset - t.data_offset % mmap.PAGESIZE
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)
        except (AttributeError, OSError, ValueError):  # another OS: the pages just stay mapped
            pass

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = self._map[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {vtype}")
        itype, n = self._unpack("<I"), self._unpack("<Q")
        if itype in _SCALARS:
            arr = np.frombuffer(self._map, np.dtype(_ARRAYS[itype]), n, self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        return [self._value(itype) for _ in range(n)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, gguf: Any, start: int, name: str, dims: tuple[int, ...], raw: int, offset: int) -> GgufTensor:
        kind = gguf.GGMLQuantizationType(raw)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims, dtype=np.int64)) * size // block
        np_dims = tuple(reversed(dims))
        plain = _PLAIN.get(kind.name)
        if plain is None:
            np_dims = (*np_dims[:-1], np_dims[-1] * size // block)
        data = np.frombuffer(self._map, plain or np.uint8, n_bytes // np.dtype(plain or np.uint8).itemsize,
                             start + offset).reshape(np_dims)
        return GgufTensor(name, dims, kind, start + offset, n_bytes, data)
