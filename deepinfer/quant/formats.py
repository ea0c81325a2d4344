"""The official DeepSeek-V4 weight formats, and a weight that stays quantized in memory.

The release stores two block-scaled formats (facts from the release's config and
from transformers' FP8 integration, which reads it):

* ``fp8_block``: ``float8_e4m3fn`` weights ``[out, in]`` with one scale per
  128x128 block, ``[ceil(out/128), ceil(in/128)]`` (attention and shared-expert
  linears). The scale multiplies: ``w = q * s``.
* ``fp4_group``: routed experts in ``e2m1``, two values per byte (the low nibble is
  the even column), ``[out, in/2]``, with one scale per 32 input columns of a row,
  ``[out, in/32]``.

Scales are ``ue8m0`` (``float8_e8m0fnu``: a bare power of two, ``2**(byte-127)``)
or float32. Every e4m3 or e2m1 value times a power of two is exactly
representable in bfloat16 and float32, so with ue8m0 scales dequantizing is
exact, and dequantizing inside the program gives the same bits as dequantizing
at load time (the same float32 multiply, then the same cast).

:class:`QuantizedArray` is a pytree (its leaves are the stored bytes and the
scales) that the model code uses like a weight array: model code only ever
calls ``w.astype(dtype)`` (dequantize) and ``w[expert_ids]`` (gather stacked
experts before dequantizing), so no layer knows whether its weights are
quantized.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_BLOCK = "fp8_block"
FP4_GROUP = "fp4_group"
KINDS = (FP8_BLOCK, FP4_GROUP)

# e2m1 code (0..15) -> value: sign bit 3, two exponent bits, one mantissa bit.
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def e8m0_to_float32_np(raw: np.ndarray) -> np.ndarray:
    """ue8m0 scale bytes (uint8 or float8_e8m0fnu) -> float32 powers of two."""
    return np.asarray(raw).view(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _e8m0_to_float32(raw: jax.Array) -> jax.Array:
    """In-program decode of ue8m0 bytes: the byte is the float32 exponent field, so
    shifting it into place is exact (byte 0, 2**-127, is below float32's normals)."""
    bits = raw.astype(jnp.uint32) << 23
    value = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(raw == 0, jnp.float32(2.0**-127), value)


def expand_scales(scale: Any, rows: int, cols: int, block: tuple[int, int], xp=np) -> Any:
    """Per-block scales repeated over their block, cut to the weight's shape."""
    s = xp.repeat(xp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :rows, :cols]


def logical_shape(kind: str, data_shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*data_shape[:-1], 2 * data_shape[-1]) if kind == FP4_GROUP else tuple(data_shape)


def dequantize_np(data: np.ndarray, scale: np.ndarray, kind: str, block: tuple[int, int]) -> np.ndarray:
    """float32 weights from stored bytes and scales (host side, at load time)."""
    s = e8m0_to_float32_np(scale) if np.asarray(scale).dtype in (np.uint8, ml_dtypes.float8_e8m0fnu) else np.asarray(scale, np.float32)
    if kind == FP8_BLOCK:
        q = np.asarray(data).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        packed = np.asarray(data).view(np.uint8)
        q = np.stack([E2M1_VALUES[packed & 0xF], E2M1_VALUES[packed >> 4]], axis=-1).reshape(logical_shape(kind, packed.shape))
    return q * expand_scales(s, q.shape[-2], q.shape[-1], block)


def dequantize(w: "QuantizedArray", dtype: Any) -> jax.Array:
    """The same as :func:`dequantize_np`, inside a program, cast to ``dtype``."""
    s = _e8m0_to_float32(w.scale) if w.scale.dtype == jnp.uint8 else w.scale.astype(jnp.float32)
    if w.kind == FP8_BLOCK:
        q = w.data.astype(jnp.float32)
    else:
        packed = w.data
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(w.shape)
        q = jnp.asarray(E2M1_VALUES)[codes]
    rows, cols = w.shape[-2:]
    return (q * expand_scales(s, rows, cols, w.block, jnp)).astype(dtype)


@jax.tree_util.register_pytree_with_keys_class
class QuantizedArray:
    """A weight kept in its checkpoint format; ``astype`` dequantizes it.

    ``data``: e4m3 ``[..., out, in]`` (fp8_block) or packed e2m1 bytes ``[..., out, in/2]``
    (fp4_group). ``scale``: float32, or uint8 ue8m0 bytes (1 byte per scale keeps FP4
    experts at 4.25 bits per weight). ``block``: the (rows, cols) each scale covers.
    ``dtype``: what the weight stands for (the model's compute dtype).
    """

    def __init__(self, data: Any, scale: Any, kind: str, block: tuple[int, int], dtype: Any):
        if kind not in KINDS:
            raise ValueError(f"unknown quantized kind {kind!r}; expected one of {KINDS}")
        self.data, self.scale, self.kind = data, scale, kind
        self.block = (int(block[0]), int(block[1]))
        self.dtype = jnp.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return logical_shape(self.kind, tuple(self.data.shape))

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.size * self.data.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    def astype(self, dtype: Any) -> jax.Array:
        return dequantize(self, dtype)

    def __getitem__(self, index: Any) -> "QuantizedArray":
        # Only stacked experts are indexed (w[expert_ids]): the leading axis, which
        # data and scale share, so the gathered experts stay quantized.
        if self.ndim < 3:
            raise TypeError("only stacked expert weights ([experts, out, in]) can be indexed while quantized")
        return QuantizedArray(self.data[index], self.scale[index], self.kind, self.block, self.dtype)

    def __repr__(self) -> str:
        return f"QuantizedArray({self.kind}, shape={self.shape}, block={self.block}, dtype={self.dtype.name})"

    def tree_flatten_with_keys(self):
        children = ((jax.tree_util.GetAttrKey("data"), self.data), (jax.tree_util.GetAttrKey("scale"), self.scale))
        return children, (self.kind, self.block, self.dtype.name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        obj.kind, obj.block, dtype = aux
        obj.dtype = jnp.dtype(dtype)
        return obj


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def dequantize_tree(params: Any, dtype: Any = None) -> Any:
    """The tree with every QuantizedArray dequantized (to ``dtype``, or the dtype each stands for)."""
    return jax.tree.map(lambda w: w.astype(dtype or w.dtype) if is_quantized(w) else w, params, is_leaf=is_quantized)
