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
    # ue8m0 scales of the official FP8 / FP4 release (a bare power of two per byte)
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# "F4": two e2m1 values per byte, the shape counting values. Read as the packed
# uint8 bytes with the last dimension halved, the layout the release's int8 FP4
# experts have, so both spellings reach the loader the same way.
_PACKED_FP4 = "F4"


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
        self._check_extents(os.path.getsize(self.path) - self._data_start)

    def _check_extents(self, data_bytes: int) -> None:
        """A truncated download or a bad header is found here, naming the tensor, before anything loads."""
        for name, entry in self._entries.items():
            try:
                start, end = (int(v) for v in entry["data_offsets"])
                shape = [int(d) for d in entry["shape"]]
                code = entry["dtype"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: tensor '{name}' has a malformed header entry") from None
            if end > data_bytes:
                raise SafetensorsError(
                    f"{self.path}: tensor '{name}' ends at byte {end} of the data section, but the file has only "
                    f"{data_bytes} (truncated file?)"
                )
            size = int(np.prod(shape, dtype=np.int64))
            bits = 4 if code == _PACKED_FP4 else 8 * _DTYPES[code].itemsize if code in _DTYPES else None
            if bits is not None and end - start != size * bits // 8:
                raise SafetensorsError(
                    f"{self.path}: tensor '{name}' is {end - start} bytes, but {code} {shape} needs {size * bits // 8}"
                )

    def nbytes(self, name: str) -> int:
        start, end = self._entries[name]["data_offsets"]
        return int(end) - int(start)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored array's shape (packed FP4: the bytes' shape, last dimension halved)."""
        shape = tuple(self._entries[name]["shape"])
        if self._entries[name]["dtype"] == _PACKED_FP4:
            return (*shape[:-1], shape[-1] // 2)
        return shape

    def dtype(self, name: str) -> np.dtype:
        code = self._entries[name]["dtype"]
        if code == _PACKED_FP4:
            return np.dtype(np.uint8)
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
        return buf.view(dtype).reshape(self.shape(name))


def open_checkpoint_files(directory: str | os.PathLike) -> Iterator[SafetensorsFile]:
    """Every .safetensors file of a checkpoint directory (via the index when there is one)."""
    files = {id(f): f for f in checkpoint_tensors(directory).values()}
    yield from files.values()


def checkpoint_tensors(directory: str | os.PathLike) -> dict[str, SafetensorsFile]:
    """``{tensor name: the file holding it}`` for a directory of one or many shards.

    With ``model.safetensors.index.json`` the index decides which shards exist
    and each tensor must be in the shard it names; every inconsistency is an error
    naming the file and the tensors, found before any tensor is read.
    """
    directory = os.fspath(directory)
    index_path = os.path.join(directory, "model.safetensors.index.json")
    weight_map = _read_index(index_path) if os.path.exists(index_path) else None
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise SafetensorsError(f"{directory}: no .safetensors files found")
    absent = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if absent:
        wanted = sorted(t for t, n in (weight_map or {}).items() if n == absent[0])
        raise SafetensorsError(
            f"{index_path}: shard {absent[0]} is missing (it holds {len(wanted)} tensors, e.g. "
            f"{', '.join(wanted[:3])})" + (f"; {len(absent) - 1} more shards are missing" if len(absent) > 1 else "")
        )
    tensors: dict[str, SafetensorsFile] = {}
    for name in names:
        f = SafetensorsFile(os.path.join(directory, name))
        for t in f.keys():
            if t in tensors:
                raise SafetensorsError(f"tensor {t} appears in both {os.path.basename(tensors[t].path)} and {name}")
            tensors[t] = f
    if weight_map is not None:
        misplaced = sorted(t for t, n in weight_map.items() if t not in tensors or os.path.basename(tensors[t].path) != n)
        if misplaced:
            t = misplaced[0]
            where = os.path.basename(tensors[t].path) if t in tensors else "no shard"
            raise SafetensorsError(
                f"{index_path}: maps {len(misplaced)} tensors to shards that do not hold them, e.g. {t} -> "
                f"{weight_map[t]} (it is in {where})"
            )
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise SafetensorsError(f"{index_path}: {len(unlisted)} tensors are in the shards but not in the index, e.g. {unlisted[0]}")
    return tensors


def _read_index(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: unreadable index ({e})") from None
    except (KeyError, TypeError):
        raise SafetensorsError(f"{path}: the index has no 'weight_map'") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(f"{path}: 'weight_map' must map tensor names to shard file names")
    return weight_map


def save_sharded(tensors: Mapping[str, np.ndarray], directory: str | os.PathLike, max_shard_bytes: int) -> list[str]:
    """Write tensors as several ``model-0000K-of-0000N.safetensors`` shards plus the index
    (the layout large releases ship in). Returns the shard names."""
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if groups[-1] and size + arr.nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = arr
        size += arr.nbytes
    shard_names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for shard, group in zip(shard_names, groups):
        save_file(group, os.path.join(directory, shard))
        weight_map.update({name: shard for name in group})
    total = sum(int(a.nbytes) for a in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return shard_names


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
