"""V4 attention over a flat token batch of many requests, reading slots and paged pools.

Each token t belongs
to a request row; its keys are (1) the window ring of its request's slot as it
was before the step, (2) the step's own tokens of the same request, (3) the
compressed rows of its request, gathered through the block table after this
step's new rows are written. Masks come from absolute positions, exactly as in
the whole-sequence attention (attention.py). The scoring and attention of the
flat batch go through pallas_kernels/ (index_select, sparse_attention): the Pallas
kernel or its pure-JAX reference, as ``cfg.kernels`` says.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer.config import CSA, HCA, ModelConfig
from deepinfer.models.deepseek_v4 import indexer
from deepinfer.models.deepseek_v4.attention import (
    output_projection,
    query_and_kv,
    rope_for,
)
from deepinfer.models.deepseek_v4.compressor import project, rows_from_positions
from deepinfer.models.deepseek_v4.rope import rope_angles
from deepinfer.models.deepseek_v4.state import POOL_OF_LAYER
from deepinfer.models.interface import FlatBatch
from deepinfer.numerics import per_token
from pallas_kernels.index_select import index_select, index_select_ref
from pallas_kernels.sparse_attention import (
    attend_parts,
    first_position,
    gather_rows,
    sparse_attention,
    sparse_attention_ref,
)


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


def compressor_inputs(p: dict, x: jax.Array, positions: jax.Array, ratio: int) -> dict:
    """Per-token compressor inputs: kv [T, W] and gate [T, W] (fp32, positional bias added)."""
    kv, gate = project(p, x)
    return {"kv": kv, "gate": gate.astype(jnp.float32) + p["ape"][jnp.mod(positions, ratio)]}


def paged_compressor(cfg, p, st, inputs: dict, fb: FlatBatch, ratio, head_dim, overlap, page_size, table) -> dict:
    """Rows closing in this step (one per closing token) written to the pool; rings updated.

    ``inputs``: this step's compressor_inputs. A row pools its window's inputs, gathered by
    position from the slot's ring or the step itself, so each row is a per-token computation."""
    ring = st["compressor"]
    closes = fb.valid & (jnp.mod(fb.positions + 1, ratio) == 0)
    if fb.write_from is not None:  # a prefix hit's replay: those rows are shared from the cache
        closes = closes & (fb.positions >= fb.write_from)
    w = jnp.maximum((fb.positions + 1) // ratio - 1, 0)

    def rows_for(w_t, length_t, start_t, slot_t):
        tb = dataclasses.replace(fb, length=length_t, start=start_t, slot=slot_t)
        return rows_from_positions(
            cfg, p, lambda pos, k: _by_position(ring[k], inputs[k], tb, pos), w_t, ratio, head_dim, overlap
        )

    rows = per_token(cfg.batch_invariant, rows_for, w, fb.length, fb.start, fb.slot)
    pool = st["rows"]
    page = jnp.take_along_axis(table, (w // page_size)[:, None], axis=1, mode="clip")[:, 0]
    page = jnp.where(closes, page, pool.shape[0])
    pool = pool.at[page, jnp.mod(w, page_size)].set(rows.astype(pool.dtype), mode="drop")
    written = {k: _write_ring(ring[k], inputs[k], fb) for k in ("kv", "gate")}
    return {"compressor": written, "rows": pool}


def paged_attention(cfg: ModelConfig, p: dict, layer_type: str, st: dict, x: jax.Array, fb: FlatBatch, page_size: int):
    """x [T, D] normed -> (output [T, D], new layer state).

    Three phases: per-token projections (query, kv, compressor and indexer inputs); the
    exchange between tokens, which only moves data (ring and pool writes, keys gathered
    by position or through block tables; pooling a compressed row is per-token work on
    gathered inputs); per-token scoring, attention and output projection.

    Batch-invariant mode runs the per-token phases in fixed token tiles
    (numerics.per_token) and gathers each token's window keys by position into a fixed
    [T, window] set, so nothing but exact data movement sees how many tokens the
    step holds. The normal path reads the slot's ring plus the step's keys, shared
    by all its tokens and masked per request.
    """
    tiled = cfg.batch_invariant
    rope = rope_for(cfg, layer_type)
    compressed = layer_type in (CSA, HCA)
    ratio = cfg.compress_ratio(layer_type) if compressed else 0

    def project_tokens(x, positions):
        cos, sin = rope_angles(rope, cfg.qk_rope_head_dim, positions)
        q_latent, q, kv = (a[0] for a in query_and_kv(cfg, p, x[None], cos[None], sin[None]))
        out = {"q": q, "kv": kv}
        if compressed:
            out["main"] = compressor_inputs(p["compressor"], x, positions, ratio)
        if layer_type == CSA:
            out["index"] = compressor_inputs(p["indexer"]["compressor"], x, positions, ratio)
            out["iq"] = indexer.index_queries(cfg, p["indexer"], q_latent[None], cos[None], sin[None])[0]
        return out

    a = per_token(tiled, project_tokens, x, fb.positions)

    # -- the exchange: data movement only --
    ring = st["window"]
    new_st = {"window": _write_ring(ring, a["kv"], fb)}
    table = None
    if compressed:
        table = fb.tables[POOL_OF_LAYER[layer_type]]
        new_st.update(paged_compressor(cfg, p["compressor"], st, a["main"], fb, ratio, cfg.head_dim,
                                       layer_type == CSA, page_size, table))
    if layer_type == CSA:
        new_st["indexer"] = paged_compressor(cfg, p["indexer"]["compressor"], st["indexer"], a["index"], fb, ratio,
                                             cfg.index_head_dim, True, page_size, table)
    if tiled:  # batch-invariant mode: the kernels' engine setup leaves attention on the reference
        out = _tiled_attention(cfg, p, layer_type, ring, new_st, a, x, fb, table, ratio)
    else:
        out = _flat_attention(cfg, p, layer_type, ring, new_st, a, x, fb, table, ratio)
    return out, new_st


def _flat_attention(cfg, p, layer_type, ring, new_st, a, x, fb: FlatBatch, table, ratio):
    """Scoring and attention over the whole flat batch through the kernel ops (pallas_kernels/): the
    Pallas kernels or their references, as cfg.kernels says (the normal path)."""
    ops = cfg.kernels
    selected = None
    if table is not None:
        n_visible = (fb.positions + 1) // ratio
    if layer_type == CSA:  # the indexer's top-k of the visible rows
        head_w = indexer.head_weights(cfg, p["indexer"], x)
        select = index_select if ops.uses("indexer") else index_select_ref
        selected, _ = select(a["iq"], head_w, new_st["indexer"]["rows"], table, n_visible, k=cfg.index_topk,
                             interpret=ops.interpret)
    elif table is not None:  # HCA: every visible row
        selected = jnp.arange(new_st["rows"].shape[1] * table.shape[1])[None, :] < n_visible[:, None]
    attend = sparse_attention if ops.uses("attention") else sparse_attention_ref
    o = attend(a["q"], a["kv"], ring, fb, new_st.get("rows"), table, selected, p["sink"], scale=cfg.head_dim**-0.5,
               window=cfg.sliding_window, interpret=ops.interpret)
    cos, sin = rope_angles(rope_for(cfg, layer_type), cfg.qk_rope_head_dim, fb.positions)
    return output_projection(cfg, p, o[None], cos[None], sin[None])[0]


def _tiled_attention(cfg, p, layer_type, ring, new_st, a, x, fb: FlatBatch, table, ratio):
    """Batch-invariant mode's reference: each token's window keys gathered by position into a fixed
    [T, window] set, and scoring + attention + output projection in fixed token tiles."""
    rope = rope_for(cfg, layer_type)
    first = first_position(fb)
    window_pos = fb.positions[:, None] - jnp.arange(cfg.sliding_window - 1, -1, -1)[None, :]
    own_keys = (_by_position(ring, a["kv"], fb, jnp.maximum(window_pos, 0)), window_pos >= first[:, None])
    rows = visible = index_rows = None
    if table is not None:
        rows = gather_rows(new_st["rows"], table)
        visible = jnp.arange(rows.shape[1])[None, :] < ((fb.positions + 1) // ratio)[:, None]
    if layer_type == CSA:
        index_rows = gather_rows(new_st["indexer"]["rows"], table)

    def attend_tokens(q, positions, x, iq, own_keys, rows, visible, index_rows):
        parts = [(*own_keys, False)]
        if layer_type == CSA:
            scores = indexer.index_scores(cfg, p["indexer"], x[:, None], iq[:, None], index_rows)[:, 0]
            visible = indexer.select_top_k(scores, visible, cfg.index_topk)
        if rows is not None:
            parts.append((rows, visible, False))
        o = attend_parts(q, parts, p["sink"], cfg.head_dim**-0.5)
        cos, sin = rope_angles(rope, cfg.qk_rope_head_dim, positions)
        return output_projection(cfg, p, o[None], cos[None], sin[None])[0]

    return per_token(True, attend_tokens, a["q"], fb.positions, x, a.get("iq"), own_keys, rows, visible, index_rows)
