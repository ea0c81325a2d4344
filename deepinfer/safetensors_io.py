"""Reading and writing .safetensors files with numpy, bf16 and fp8 included.

The safetensors package's numpy and flax backends cannot return bfloat16 tensors
(numpy has no such dtype), and real checkpoints are bf16/fp8. The format is
simple — an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then the raw bytes — so tensors are
read here as zero-copy views of a memory map, with ml_dtypes supplying the
dtypes numpy lacks.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    """Lazy access to the tensors of one file: ``keys()``, ``shape(k)``, ``get(k)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise SafetensorsError(f"{self.path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", raw_len)
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{self.path}: unreadable header ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._entries: dict[str, dict] = header
        self._data_start = 8 + header_len
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._entries[name]["dtype"]
        if code not in _DTYPES:
            raise SafetensorsError(f"{self.path}: tensor '{name}' has unsupported dtype {code}")
        return _DTYPES[code]

    def get(self, name: str) -> np.ndarray:
        """A read-only view of one tensor (no copy)."""
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        entry = self._entries[name]
        start, end = entry["data_offsets"]
        dtype = self.dtype(name)
        buf = self._mmap[self._data_start + start : self._data_start + end]
        return buf.view(dtype).reshape(entry["shape"])


def open_checkpoint_files(directory: str | os.PathLike) -> Iterator[SafetensorsFile]:
    """Every .safetensors file of a checkpoint directory (via the index when there is one)."""
    directory = os.fspath(directory)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        raise SafetensorsError(f"{directory}: no .safetensors files found")
    for name in files:
        yield SafetensorsFile(os.path.join(directory, name))


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write numpy arrays (bf16 / fp8 via ml_dtypes allowed) as one safetensors file."""
    header: dict[str, dict] = {}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"tensor '{name}': dtype {arr.dtype} cannot be stored")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
