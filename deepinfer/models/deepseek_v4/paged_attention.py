"""V4 attention over a flat token batch of many requests, reading slots and paged pools.

Pure-JAX reference (a Pallas kernel will have to match it). Each token t belongs
to a request row; its keys are (1) the window ring of its request's slot as it
was before the step, (2) the step's own tokens of the same request, (3) the
compressed rows of its request, gathered through the block table after this
step's new rows are written. Masks come from absolute positions, exactly as in
the contiguous path (cached_attention.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from deepinfer.config import CSA, HCA, ModelConfig
from deepinfer.kv.paged_state import POOL_OF_LAYER
from deepinfer.kv.ring import ring_positions
from deepinfer.models.deepseek_v4 import indexer
from deepinfer.models.deepseek_v4.attention import output_projection, query_and_kv, rope_for, sink_softmax
from deepinfer.models.deepseek_v4.compressor import project, rows_from_positions
from deepinfer.models.deepseek_v4.ops import token_tiled
from deepinfer.models.deepseek_v4.rope import rope_angles


@dataclass(frozen=True)
class FlatBatch:
    """Per-token views of a packed step (all [T]); tables: pool -> per-token block table [T, max_pages]."""

    positions: jax.Array
    valid: jax.Array
    row: jax.Array
    slot: jax.Array
    length: jax.Array  # the request's computed length before the step
    start: jax.Array  # flat index of the request's first token in the step
    end: jax.Array  # length + n_new of the request
    tables: dict


def _take_slots(arr: jax.Array, slots: jax.Array) -> jax.Array:
    return jnp.take(arr, slots, axis=0, mode="clip")


def _by_position(ring: jax.Array, chunk: jax.Array, fb: FlatBatch, positions: jax.Array) -> jax.Array:
    """Per-token values at absolute positions [T, n] of the token's own request:
    from its slot's ring (p < length) or from this step's flat batch (p >= length)."""
    size = ring.shape[1]
    length, start = fb.length[:, None], fb.start[:, None]
    in_step = positions >= length
    flat_idx = jnp.clip(start + positions - length, 0, chunk.shape[0] - 1)
    from_step = jnp.take(chunk, flat_idx, axis=0)
    from_ring = ring[jnp.clip(fb.slot, 0, ring.shape[0] - 1)[:, None], jnp.mod(positions, size)]
    return jnp.where(in_step[..., None], from_step.astype(ring.dtype), from_ring)


def _write_ring(ring: jax.Array, values: jax.Array, fb: FlatBatch) -> jax.Array:
    """Each valid token writes its slot's ring at position % size, if it is among its request's last `size`."""
    size = ring.shape[1]
    write = fb.valid & (fb.positions >= fb.end - size)
    slots = jnp.where(write, fb.slot, ring.shape[0])
    return ring.at[slots, jnp.mod(fb.positions, size)].set(values.astype(ring.dtype), mode="drop")


def paged_compressor(cfg, p, st, x, fb: FlatBatch, ratio, head_dim, overlap, page_size, table) -> dict:
    """Rows closing in this step (one per closing token) written to the pool; rings updated."""
    kv, gate = project(p, x)
    gate = gate.astype(jnp.float32) + p["ape"][jnp.mod(fb.positions, ratio)]
    ring = st["compressor"]
    closes = fb.valid & (jnp.mod(fb.positions + 1, ratio) == 0)
    w = (fb.positions + 1) // ratio - 1
    inputs = {"kv": kv, "gate": gate}
    if cfg.batch_invariant:
        def tile_rows(w_t, length_t, start_t, slot_t):
            tb = dataclasses.replace(fb, length=length_t, start=start_t, slot=slot_t)
            return rows_from_positions(
                cfg, p, lambda pos, k: _by_position(ring[k], inputs[k], tb, pos), w_t, ratio, head_dim, overlap
            )

        rows = token_tiled(tile_rows, jnp.maximum(w, 0), fb.length, fb.start, fb.slot)
    else:
        rows = rows_from_positions(
            cfg, p, lambda pos, k: _by_position(ring[k], inputs[k], fb, pos), jnp.maximum(w, 0), ratio, head_dim, overlap
        )
    pool = st["rows"]
    page = jnp.take_along_axis(table, (jnp.maximum(w, 0) // page_size)[:, None], axis=1, mode="clip")[:, 0]
    page = jnp.where(closes, page, pool.shape[0])
    pool = pool.at[page, jnp.mod(jnp.maximum(w, 0), page_size)].set(rows.astype(pool.dtype), mode="drop")
    return {"compressor": {"kv": _write_ring(ring["kv"], kv, fb), "gate": _write_ring(ring["gate"], gate, fb)}, "rows": pool}


def _gather_rows(pool: jax.Array, table: jax.Array) -> jax.Array:
    """pool [pages, page_size, d], table [T, max_pages] -> each token's request rows [T, max_pages * page_size, d]."""
    rows = jnp.take(pool, table, axis=0, mode="clip")
    return rows.reshape(table.shape[0], -1, pool.shape[-1])


def _attend_parts(q, parts, sink, scale):
    """Sink softmax over several key sets. q [T, H, hd]; parts: (keys, mask, shared) with keys
    [T, K, hd] per token or [K, hd] shared by all tokens, mask [T, K]. Returns [T, H, hd]."""
    logits = []
    for keys, mask, shared in parts:
        eq = "thd,kd->thk" if shared else "thd,tkd->thk"
        lg = jnp.einsum(eq, q.astype(jnp.float32), keys.astype(jnp.float32)) * scale
        logits.append(jnp.where(mask[:, None, :], lg, -jnp.inf))
    probs = sink_softmax(jnp.concatenate(logits, axis=-1), sink.astype(jnp.float32)[None, :])
    out, at = 0.0, 0
    for keys, _, shared in parts:
        k = keys.shape[0] if shared else keys.shape[1]
        pr = probs[..., at : at + k]
        eq = "thk,kd->thd" if shared else "thk,tkd->thd"
        out = out + jnp.einsum(eq, pr, keys.astype(jnp.float32))
        at += k
    return out.astype(q.dtype)


def paged_attention(cfg: ModelConfig, p: dict, layer_type: str, st: dict, x: jax.Array, fb: FlatBatch, page_size: int):
    """x [T, D] normed -> (output [T, D], new layer state)."""
    cos, sin = rope_angles(rope_for(cfg, layer_type), cfg.qk_rope_head_dim, fb.positions)
    q_latent, q, kv = query_and_kv(cfg, p, x[None], cos[None], sin[None])
    q_latent, q, kv = q_latent[0], q[0], kv[0]

    ring = st["window"]
    if cfg.batch_invariant:
        # Each token's window keys gathered by position (from the ring or this step), a fixed
        # [T, window] set in position order: the same reduction whatever the step holds.
        window_pos = fb.positions[:, None] - jnp.arange(cfg.sliding_window - 1, -1, -1)[None, :]
        keys = _by_position(ring, kv, fb, jnp.maximum(window_pos, 0))
        parts = [(keys, window_pos >= 0, False)]
    else:
        ring_keys = _take_slots(ring, fb.slot)
        ring_pos = ring_positions(fb.length, ring.shape[1])
        d = fb.positions[:, None] - ring_pos
        ring_mask = (ring_pos >= 0) & (d >= 0) & (d < cfg.sliding_window)
        d2 = fb.positions[:, None] - fb.positions[None, :]
        step_mask = (fb.row[:, None] == fb.row[None, :]) & fb.valid[None, :] & (d2 >= 0) & (d2 < cfg.sliding_window)
        parts = [(ring_keys, ring_mask, False), (kv, step_mask, True)]
    new_st = {"window": _write_ring(ring, kv, fb)}

    if layer_type in (CSA, HCA):
        ratio = cfg.compress_ratio(layer_type)
        table = fb.tables[POOL_OF_LAYER[layer_type]]
        main = paged_compressor(cfg, p["compressor"], st, x, fb, ratio, cfg.head_dim, layer_type == CSA, page_size, table)
        new_st.update(main)
        rows = _gather_rows(main["rows"], table)
        visible = jnp.arange(rows.shape[1])[None, :] < ((fb.positions + 1) // ratio)[:, None]
        if layer_type == CSA:
            ip = p["indexer"]
            idx = paged_compressor(cfg, ip["compressor"], st["indexer"], x, fb, ratio, cfg.index_head_dim, True, page_size, table)
            new_st["indexer"] = idx
            iq = indexer.index_queries(cfg, ip, q_latent[None], cos[None], sin[None])
            scores = jax.vmap(lambda xi, qi, ki: indexer.index_scores(cfg, ip, xi[None, None], qi[None, None], ki[None])[0, 0])(
                x, iq[0], _gather_rows(idx["rows"], table)
            )
            visible = indexer.select_top_k(scores, visible, cfg.index_topk)
        parts.append((rows, visible, False))

    o = _attend_parts(q, parts, p["sink"], cfg.head_dim**-0.5)
    out = output_projection(cfg, p, o[None], cos[None], sin[None])[0]
    return out, new_st
