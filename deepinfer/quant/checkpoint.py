"""Recognising quantized tensors in a checkpoint: pairing weights with their scales, checking the layout.

The release names a weight's scale ``<module>.scale`` beside ``<module>.weight``;
transformers' FP8 format spells it ``<module>.weight_scale_inv`` (the same
multiplier, despite the name). A weight's format follows from its stored dtype:
e4m3 -> FP8 blocks; int8 / uint8 / packed F4 -> FP4 groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from deepinfer.quant.formats import FP4_GROUP, FP8_BLOCK, logical_shape

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.uint8))
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_PACKED = (np.dtype(np.int8), np.dtype(np.uint8))


@dataclass(frozen=True)
class StoredFormat:
    """How one on-disk weight is stored: ``kind`` (FP8_BLOCK / FP4_GROUP), the (rows, cols)
    block each scale covers, and the weight's logical (unpacked) shape."""

    kind: str
    block: tuple[int, int]
    shape: tuple[int, ...]


def weight_of_scale(name: str) -> str | None:
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def pair_scales(named: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Split ``named`` into (weights, {weight name: its scale tensor}, problems).

    A ``.scale`` with no ``.weight`` beside it stays a tensor of its own (V4 has
    such, e.g. ``hc_attn_scale``'s transformers spelling ``attn_hc.scale``).
    """
    scales: dict[str, Any] = {}
    paired: set[str] = set()
    problems: list[str] = []
    for name in named:
        weight = weight_of_scale(name)
        if weight is None or weight not in named:
            continue
        paired.add(name)
        if weight in scales:
            problems.append(f"{name} (a second scale for {weight})")
        else:
            scales[weight] = named[name]
    return {n: t for n, t in named.items() if n not in paired}, scales, problems


def stored_format(name: str, tensor: Any, scale: Any | None, fp8_block: tuple[int, int]) -> StoredFormat | str | None:
    """The quantized layout of ``tensor`` (None when it is a plain float tensor), or a problem text."""
    dtype = np.dtype(tensor.dtype)
    if scale is None:
        if dtype == _FP8:
            return f"{name}: an FP8 weight without its scale ({name[: -len('.weight')]}.scale)"
        return None
    if np.dtype(scale.dtype) not in _SCALE_DTYPES:
        return f"{name}: its scale has dtype {np.dtype(scale.dtype)}; expected float32, bfloat16 or ue8m0 (F8_E8M0)"
    shape, sshape = tuple(tensor.shape), tuple(scale.shape)
    if len(shape) < 2 or len(sshape) != len(shape) or sshape[:-2] != shape[:-2]:
        return f"{name}: scale shape {sshape} does not fit weight shape {shape}"
    if dtype == _FP8:
        rows, cols = shape[-2:]
        want = (*shape[:-2], -(-rows // fp8_block[0]), -(-cols // fp8_block[1]))
        if sshape != want:
            return f"{name}: FP8 scale shape {sshape}, expected {want} for {fp8_block[0]}x{fp8_block[1]} blocks"
        return StoredFormat(FP8_BLOCK, fp8_block, shape)
    if dtype in _PACKED:
        full = logical_shape(FP4_GROUP, shape)
        rows, cols = full[-2:]
        if sshape[-2] != rows or sshape[-1] == 0 or cols % sshape[-1]:
            return f"{name}: FP4 scale shape {sshape} does not divide the unpacked weight {full} into row groups"
        return StoredFormat(FP4_GROUP, (1, cols // sshape[-1]), full)
    return f"{name}: has a scale but dtype {dtype}; quantized weights are float8_e4m3fn (FP8) or int8 / F4 (packed FP4)"
