"""Compressors over a decode state: rows close as the tokens that end their windows arrive.

For a chunk of C new tokens per sequence (positions length .. length + n_valid - 1)
the rows whose windows close inside the chunk are pooled from the per-token ring
(earlier tokens) and the chunk itself, normed, roped, and written into the row
store. The pooling is the whole-sequence compressor's (compressor.py), so a row
is bit-for-bit the same whichever way the tokens arrive.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.kv.ring import gather_by_position, ring_write
from deepinfer.models.deepseek_v4.compressor import project, rows_from_positions


def extend_compressor(
    cfg: ModelConfig,
    p: dict,
    st: dict,
    x: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    n_valid: jax.Array,
    ratio: int,
    head_dim: int,
    overlap: bool,
) -> dict:
    """Update one compressor's state with a chunk.

    st: {"compressor": {"kv", "gate"} rings [B, P, W], "rows": [B, T, hd]}; x [B, C, D]
    (the normed attention input); positions [B, C]; lengths [B] before the chunk;
    n_valid [B] real tokens in the chunk. Returns the new st.
    """
    b, c, _ = x.shape
    kv, gate = project(p, x)
    gate = gate.astype(jnp.float32) + p["ape"][jnp.mod(positions, ratio)]
    ring = st["compressor"]

    # Rows that close inside this chunk: w in [length // ratio, (length + n_valid) // ratio).
    n_slots = c // ratio + 1
    first = lengths // ratio
    w = first[:, None] + jnp.arange(n_slots)[None, :]  # [B, M]
    closes = w < ((lengths + n_valid) // ratio)[:, None]
    inputs = {"kv": kv, "gate": gate}
    rows = rows_from_positions(
        cfg, p, lambda pos, k: gather_by_position(ring[k], inputs[k], lengths, pos), w, ratio, head_dim, overlap
    )

    store = st["rows"]
    target = jnp.where(closes, w, store.shape[1])  # out of range: dropped
    store = store.at[jnp.arange(b)[:, None], target].set(rows.astype(store.dtype), mode="drop")
    new_ring = {
        "kv": ring_write(ring["kv"], kv, positions, n_valid),
        "gate": ring_write(ring["gate"], gate, positions, n_valid),
    }
    return {"compressor": new_ring, "rows": store}
