"""Interleaved rotary embedding on the trailing ``qk_rope_head_dim`` channels.

V4 pairs consecutive channels (x0, x1), (x2, x3), ... of the rope slice and lays a
head out as ``[nope | rope]``. Sliding-only layers use the "main" rope
(``rope_theta``); CSA/HCA layers — their attention and their compressors — use the
"compress" rope (``compress_rope_theta``, optionally YaRN-scaled).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, dim: int) -> np.ndarray:
    """One frequency per channel pair: [dim // 2] float32 (host constant, computed once per trace)."""
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    # YaRN: interpolate the low frequencies, keep the high ones, ramp between.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_weight = 1 - ramp
    interpolated = (1.0 / (rope.factor * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight).astype(np.float32)


def rope_angles(rope: RopeConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [*positions.shape, dim // 2] (fp32), scaled by the attention factor."""
    inv_freq = jnp.asarray(inverse_frequencies(rope, dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(freqs) * rope.attention_factor, jnp.sin(freqs) * rope.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the trailing 2*cos.shape[-1] channels of x in interleaved pairs.

    x: [..., S, (heads,) C]; cos/sin: [..., S, rd/2] and broadcast over a heads
    axis when x has one more dimension than cos. Computed in fp32.
    """
    half = cos.shape[-1]
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    nope, rot = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half :]
    pairs = rot.astype(jnp.float32).reshape(*rot.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out_even = even * cos - odd * sin
    out_odd = odd * cos + even * sin
    rotated = jnp.stack([out_even, out_odd], axis=-1).reshape(rot.shape).astype(x.dtype)
    return jnp.concatenate([nope, rotated], axis=-1)
