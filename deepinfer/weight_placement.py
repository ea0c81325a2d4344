"""One checkpoint tensor -> one device array (or QuantizedArray), streamed into its target sharding.

The host never holds more than the tensor being placed: a plain or dequantized
weight is produced by a callback per device shard (``jax.make_array_from_callback``),
so with a sharded target each device's slice is read from the memory-mapped file
and converted on its own; stacked experts read only the experts of that slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer.quant.checkpoint import StoredFormat
from deepinfer.quant.formats import FP8_BLOCK, QuantizedArray, dequantize_np


@dataclass(frozen=True)
class Source:
    """One stored tensor: the array-like (read lazily), its scale, its quantized layout (or None)."""

    name: str
    tensor: Any
    scale: Any = None
    fmt: StoredFormat | None = None

    @property
    def nbytes(self) -> int:
        total = _nbytes(self.tensor)
        return total + (_nbytes(self.scale) if self.scale is not None else 0)


def _nbytes(x: Any) -> int:
    n = getattr(x, "nbytes", None)
    return int(n) if n is not None else int(np.asarray(x).nbytes)


def _host_float(src: Source) -> np.ndarray:
    if src.fmt is None:
        return np.asarray(src.tensor)
    check_scales(src.name, src.scale)
    return dequantize_np(np.asarray(src.tensor), np.asarray(src.scale), src.fmt.kind, src.fmt.block)


def _cast(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # numpy (ml_dtypes) rounds float32 -> bfloat16 to nearest-even, as XLA does
    return arr if arr.dtype == dtype else arr.astype(dtype)


def check_scales(name: str, scale: Any) -> None:
    """ue8m0 byte 255 is NaN: a corrupt scale must not load as a NaN weight."""
    s = np.asarray(scale)
    if s.dtype in (np.uint8, ml_dtypes.float8_e8m0fnu) and (s.view(np.uint8) == 255).any():
        raise ValueError(f"{name}: its ue8m0 scale holds 0xFF (NaN)")
    if s.dtype.kind == "f" and not np.isfinite(s.astype(np.float32)).all():
        raise ValueError(f"{name}: its scale holds a non-finite value")


def _reader(parts: list[Source] | Source, convert: Callable[[Source], np.ndarray]) -> Callable[[tuple], np.ndarray]:
    """index (a tuple of slices) -> that slice of the tensor, reading only stacked experts it covers."""
    if isinstance(parts, Source):
        return lambda index: convert(parts)[index]

    def read(index: tuple) -> np.ndarray:
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        rows = range(len(parts))[first]
        return np.stack([convert(parts[e])[rest] for e in rows])

    return read


def _place(shape: tuple[int, ...], dtype: np.dtype, sharding, read: Callable[[tuple], np.ndarray]) -> jax.Array:
    if sharding is None:
        return jax.device_put(_cast(read(tuple(slice(None) for _ in shape)), dtype))
    return jax.make_array_from_callback(shape, sharding, lambda index: _cast(read(index), dtype))


def part_sharding(sharding, shape: tuple[int, ...]):
    """The sharding of a quantized weight's data or scale array, from the weight's own sharding.

    The data and scale share the weight's rank and axis meaning, so the weight's
    PartitionSpec fits them, except where a part is too small to split: an FP8
    scale has one row per 128 weight rows (a 256-row weight over 4 devices has 2
    scale rows). Such a part is small, so it is replicated on the same mesh rather
    than refused; None, or a sharding that is not a NamedSharding, is used as it is.
    Loading (here) and orbax restores (orbax_manifest.py) both place parts by it.
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    mesh = sharding.mesh
    for size, axes in zip(shape, sharding.spec):
        if axes is None:
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if size % int(np.prod([mesh.shape[n] for n in names])):
            return NamedSharding(mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    return sharding


def place_weight(parts: list[Source] | Source, shape: tuple[int, ...], dtype: Any, *, keep_quantized: bool, sharding=None):
    """The parameter of logical ``shape`` and compute ``dtype`` from its stored source(s).

    ``parts`` is one Source, or one per expert for a stacked ``[experts, ...]`` weight.
    Quantized sources are dequantized (float32 math, then cast) unless ``keep_quantized``.
    """
    dtype = np.dtype(dtype)
    first = parts if isinstance(parts, Source) else parts[0]
    if first.fmt is None or not keep_quantized:
        return _place(shape, dtype, sharding, _reader(parts, _host_float))
    fmt = first.fmt
    data_dtype = np.dtype(ml_dtypes.float8_e4m3fn) if fmt.kind == FP8_BLOCK else np.dtype(np.uint8)
    raw_scale = np.dtype(first.scale.dtype)
    # ue8m0 scales stay one byte each (a quarter of FP4's 4 bits per weight would otherwise double)
    scale_dtype = np.dtype(np.uint8) if raw_scale in (np.uint8, ml_dtypes.float8_e8m0fnu) else np.dtype(np.float32)

    def data_of(src: Source) -> np.ndarray:
        return np.asarray(src.tensor).view(data_dtype)

    def scale_of(src: Source) -> np.ndarray:
        check_scales(src.name, src.scale)
        s = np.asarray(src.scale)
        return s.view(np.uint8) if scale_dtype == np.uint8 else s.astype(np.float32)

    stacked = not isinstance(parts, Source)
    data_shape = ((len(parts),) if stacked else ()) + tuple(np.shape(first.tensor))
    scale_shape = ((len(parts),) if stacked else ()) + tuple(np.shape(first.scale))
    data = _place(data_shape, data_dtype, part_sharding(sharding, data_shape), _reader(parts, data_of))
    scale = _place(scale_shape, scale_dtype, part_sharding(sharding, scale_shape), _reader(parts, scale_of))
    return QuantizedArray(data, scale, fmt.kind, fmt.block, jnp.dtype(dtype))
