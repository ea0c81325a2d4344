"""KV compressors: one compressed row per ``ratio`` tokens (CSA: 4, HCA: 128).

Each token projects to a kv vector and a gate vector; a row is the softmax-gated
pool (over the window, per channel) of the window's kv, then RMSNorm, then rope at
the row's position ``w * ratio``.

CSA windows overlap: projections are 2x wide. The first half ("Ca") of window
w-1 and the second half ("Cb") of window w pool together into row w (width
2*ratio, stride ratio). Row 0 has no previous window: those slots get gate -inf.
HCA windows do not overlap. The CSA indexer runs the same compressor at
``index_head_dim``.

A query at position t sees row w only when w's window is complete:
``w < (t + 1) // ratio``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig, RopeConfig
from deepinfer.models.deepseek_v4.ops import linear, rms_norm
from deepinfer.models.deepseek_v4.rope import apply_rope, rope_angles
from deepinfer.numerics import fixed_softmax, fixed_sum


def pool_windows(
    kv: jax.Array,
    gate: jax.Array,
    head_dim: int,
    overlap: bool,
    prev_tail: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Softmax-gated pool of complete windows.

    kv, gate: [..., n, ratio, C] with C = 2*head_dim if overlap else head_dim; gate
    already includes the positional bias. prev_tail: the Ca halves (kv, gate) of the
    window before the first one, [..., ratio, head_dim] each, or None when there is
    none. Returns un-normalised rows [..., n, head_dim] in kv's dtype.
    """
    if overlap:
        ca_kv, cb_kv = kv[..., :head_dim], kv[..., head_dim:]
        ca_gate, cb_gate = gate[..., :head_dim], gate[..., head_dim:]
        if prev_tail is None:
            first_kv = jnp.zeros_like(ca_kv[..., :1, :, :])
            first_gate = jnp.full_like(ca_gate[..., :1, :, :], -jnp.inf)
        else:
            first_kv = prev_tail[0][..., None, :, :].astype(ca_kv.dtype)
            first_gate = prev_tail[1][..., None, :, :].astype(ca_gate.dtype)
        # Window w pools [Ca of window w-1 | Cb of window w].
        prev_kv = jnp.concatenate([first_kv, ca_kv[..., :-1, :, :]], axis=-3)
        prev_gate = jnp.concatenate([first_gate, ca_gate[..., :-1, :, :]], axis=-3)
        kv = jnp.concatenate([prev_kv, cb_kv], axis=-2)
        gate = jnp.concatenate([prev_gate, cb_gate], axis=-2)
    weights = fixed_softmax(gate.astype(jnp.float32), axis=-2).astype(kv.dtype)
    return fixed_sum(kv * weights, axis=-2)


def finish_rows(
    pooled: jax.Array, norm_w: jax.Array, eps: float, rope: RopeConfig, rope_dim: int, positions: jax.Array
) -> jax.Array:
    """RMSNorm then rope at each row's first-token position. pooled: [..., n, hd]; positions: [..., n]."""
    rows = rms_norm(pooled, norm_w, eps)
    cos, sin = rope_angles(rope, rope_dim, positions)
    return apply_rope(rows, cos, sin)


def rows_from_positions(
    cfg: ModelConfig, p: dict, gather: Callable[[jax.Array, str], jax.Array], rows: jax.Array, ratio: int, head_dim: int, overlap: bool
) -> jax.Array:
    """Compressed rows ``rows`` [...] (row indices) from per-token compressor inputs looked up by position.

    ``gather(positions, "kv" | "gate")`` returns the stored inputs of those token
    positions ([..., r] -> [..., r, W]) wherever they live (a ring, the current
    chunk). Windows are assembled as in pool_windows (CSA: Ca of the previous
    window | Cb of this one), pooled, normed and roped. Returns [..., hd].
    """
    tok = rows[..., None] * ratio + jnp.arange(ratio)
    cur_kv, cur_gate = gather(tok, "kv"), gather(tok, "gate")
    if overlap:
        prev = tok - ratio
        has_prev = (prev >= 0)[..., None]
        prev_kv = gather(jnp.maximum(prev, 0), "kv")[..., :head_dim]
        prev_gate = gather(jnp.maximum(prev, 0), "gate")[..., :head_dim]
        cur_kv = jnp.concatenate([jnp.where(has_prev, prev_kv, 0), cur_kv[..., head_dim:]], axis=-2)
        cur_gate = jnp.concatenate([jnp.where(has_prev, prev_gate, -jnp.inf), cur_gate[..., head_dim:]], axis=-2)
    pooled = pool_windows(cur_kv, cur_gate, head_dim, overlap=False)  # windows already assembled
    return finish_rows(pooled, p["norm"], cfg.rms_norm_eps, cfg.compress_rope, cfg.qk_rope_head_dim, rows * ratio)


def project(p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token compressor inputs: kv and gate, [..., S, C] each (gate in fp32 with no bias yet)."""
    return linear(x, p["wkv"]), linear(x, p["wgate"])


def compress_sequence(
    cfg: ModelConfig, p: dict, x: jax.Array, ratio: int, head_dim: int, overlap: bool
) -> jax.Array:
    """All complete windows of a whole sequence: x [B, S, D] -> rows [B, S // ratio, hd].

    Trailing tokens that do not fill a window produce no row.
    """
    b, s, _ = x.shape
    n = s // ratio
    kv, gate = project(p, x[:, : n * ratio])
    width = kv.shape[-1]
    kv = kv.reshape(b, n, ratio, width)
    gate = gate.reshape(b, n, ratio, width).astype(jnp.float32) + p["ape"]
    pooled = pool_windows(kv, gate, head_dim, overlap)
    positions = jnp.broadcast_to(jnp.arange(n) * ratio, (b, n))
    return finish_rows(pooled, p["norm"], cfg.rms_norm_eps, cfg.compress_rope, cfg.qk_rope_head_dim, positions)


def visible_rows(query_positions: jax.Array, n_rows: int, ratio: int) -> jax.Array:
    """[..., S] positions -> [..., S, n_rows] bool: row w is complete for the query at t."""
    return jnp.arange(n_rows) < ((query_positions + 1) // ratio)[..., None]
