"""Ring buffers indexed by absolute token position (slot = position % size)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_positions(lengths: jax.Array, size: int) -> jax.Array:
    """[B] committed lengths -> [B, size] the position each slot holds (the latest
    p < length with p % size == slot), or -1 when the slot was never filled."""
    slots = jnp.arange(size)
    last = lengths[:, None] - 1
    pos = last - jnp.mod(last - slots[None, :], size)
    return jnp.where(pos >= 0, pos, -1)


def ring_write(ring: jax.Array, values: jax.Array, positions: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Write chunk values [B, C, ...] at their positions [B, C] into ring [B, size, ...].

    Only the valid tokens (index < n_valid[b]) are written, and of those only the
    last ``size`` (earlier ones would share slots; scatter order is unspecified).
    """
    size = ring.shape[1]
    idx = jnp.arange(positions.shape[1])[None, :]
    keep = (idx < n_valid[:, None]) & (idx >= n_valid[:, None] - size)
    slots = jnp.where(keep, jnp.mod(positions, size), size)  # `size` is out of range: dropped
    batch = jnp.arange(ring.shape[0])[:, None]
    return ring.at[batch, slots].set(values.astype(ring.dtype), mode="drop")


def gather_by_position(ring: jax.Array, chunk: jax.Array, lengths: jax.Array, positions: jax.Array) -> jax.Array:
    """Values at absolute positions [B, ...] from the ring (p < length) or the chunk (p >= length).

    ring [B, size, W], chunk [B, C, W] (chunk token i is at position length + i).
    Positions must be >= 0 and within the ring's history or the chunk.
    """
    size = ring.shape[1]
    source = jnp.concatenate([ring, chunk.astype(ring.dtype)], axis=1)
    idx = jnp.where(positions >= lengths.reshape(-1, *([1] * (positions.ndim - 1))),
                    size + positions - lengths.reshape(-1, *([1] * (positions.ndim - 1))),
                    jnp.mod(positions, size))
    flat = idx.reshape(idx.shape[0], -1)
    out = jnp.take_along_axis(source, flat[..., None], axis=1, mode="clip")
    return out.reshape(*positions.shape, source.shape[-1])
