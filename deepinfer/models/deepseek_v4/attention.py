"""V4 attention for a whole sequence: sliding window + (CSA | HCA) compressed rows + sinks.

One latent KV head (keys are also values), a low-rank query with per-head
unweighted RMSNorm, rope on the trailing ``qk_rope_head_dim`` channels, a learned
per-head sink logit in the softmax denominator, inverse rope on the output, and a
grouped low-rank output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.models.deepseek_v4 import compressor, indexer
from deepinfer.models.deepseek_v4.ops import (
    einsum_f32,
    linear,
    rms_norm,
    unweighted_rms_norm,
)
from deepinfer.models.deepseek_v4.rope import apply_rope, rope_angles
from deepinfer.numerics import fixed_sum


def rope_for(cfg: ModelConfig, layer_type: str):
    """Sliding-only layers use the main rope; CSA/HCA layers the compress rope."""
    return cfg.main_rope if layer_type == SLIDING else cfg.compress_rope


def query_and_kv(
    cfg: ModelConfig, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, S, D] -> q_latent [B, S, q_lora], q [B, S, H, hd], kv [B, S, hd] (both roped)."""
    q_latent = rms_norm(linear(x, p["wq_a"]), p["q_norm"], cfg.rms_norm_eps)
    q = linear(q_latent, p["wq_b"]).reshape(*x.shape[:-1], cfg.num_attention_heads, cfg.head_dim)
    q = apply_rope(unweighted_rms_norm(q, cfg.rms_norm_eps), cos, sin)
    kv = rms_norm(linear(x, p["wkv"]), p["kv_norm"], cfg.rms_norm_eps)
    return q_latent, q, apply_rope(kv, cos, sin)


def attend_with_sink(q: jax.Array, keys: jax.Array, mask: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """Softmax attention over one shared KV head, with a per-head sink logit.

    q [B, S, H, hd], keys [B, K, hd] (also the values), mask [B, S, K] bool,
    sink [H]. The sink joins the denominator only. Returns [B, S, H, hd].
    """
    logits = einsum_f32("bshd,bkd->bhsk", q, keys) * scale
    logits = jnp.where(mask[:, None, :, :], logits, -jnp.inf)
    probs = sink_softmax(logits, sink.astype(jnp.float32)[None, :, None]).astype(keys.dtype)
    return einsum_f32("bhsk,bkd->bshd", probs, keys).astype(keys.dtype)


def sink_softmax(logits: jax.Array, sink: jax.Array) -> jax.Array:
    """Softmax over the last axis with an extra sink logit that joins the denominator only.

    logits [..., K] (fp32, -inf where masked); sink broadcastable to logits[..., 0].
    Never NaN: with every key masked the sink takes all the mass and the result is 0.
    """
    peak = jnp.maximum(jnp.max(logits, axis=-1), sink)
    weights = jnp.exp(logits - peak[..., None])
    return weights / (fixed_sum(weights, axis=-1) + jnp.exp(sink - peak))[..., None]


def output_projection(cfg: ModelConfig, p: dict, o: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Undo the rope that values carried (rotate by -position), then the grouped low-rank projection.

    o [B, S, H, hd] -> [B, S, D]. Head group g (H/G heads) maps to its own o_lora_rank slice.
    """
    o = apply_rope(o, cos, -sin)
    g = cfg.o_groups
    grouped = o.reshape(*o.shape[:-2], g, -1)  # [B, S, G, H*hd/G]
    wo_a = p["wo_a"].astype(o.dtype).reshape(g, cfg.o_lora_rank, -1)  # [G, R, H*hd/G]
    mid = einsum_f32("bsgk,grk->bsgr", grouped, wo_a).astype(o.dtype)
    return linear(mid.reshape(*mid.shape[:-2], -1), p["wo_b"])


def sliding_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """[B, S], [B, K] -> [B, S, K]: causal and within the last ``window`` tokens (self included)."""
    d = q_pos[:, :, None] - k_pos[:, None, :]
    return (d >= 0) & (d < window)


def attention(cfg: ModelConfig, p: dict, layer_type: str, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict]:
    """Attention sub-layer over whole sequences starting at position 0.

    x [B, S, D] (already normed), positions [B, S]. Returns the output [B, S, D]
    and intermediates for layer-by-layer debugging: "compressed" rows [B, T, hd],
    and for CSA "index_rows" [B, T, ID] and "selected" [B, S, T] bool.
    """
    cos, sin = rope_angles(rope_for(cfg, layer_type), cfg.qk_rope_head_dim, positions)
    q_latent, q, kv = query_and_kv(cfg, p, x, cos, sin)
    keys, mask = kv, sliding_mask(positions, positions, cfg.sliding_window)
    aux: dict = {}
    if layer_type in (CSA, HCA):
        ratio = cfg.compress_ratio(layer_type)
        rows = compressor.compress_sequence(cfg, p["compressor"], x, ratio, cfg.head_dim, overlap=layer_type == CSA)
        visible = compressor.visible_rows(positions, rows.shape[1], ratio)
        aux["compressed"] = rows
        if layer_type == CSA:
            ip = p["indexer"]
            index_rows = compressor.compress_sequence(cfg, ip["compressor"], x, ratio, cfg.index_head_dim, overlap=True)
            iq = indexer.index_queries(cfg, ip, q_latent, cos, sin)
            scores = indexer.index_scores(cfg, ip, x, iq, index_rows)
            visible = indexer.select_top_k(scores, visible, cfg.index_topk)
            aux["index_rows"], aux["selected"] = index_rows, visible
        keys = jnp.concatenate([kv, rows.astype(kv.dtype)], axis=1)
        mask = jnp.concatenate([mask, visible], axis=-1)
    o = attend_with_sink(q, keys, mask, p["sink"], cfg.head_dim**-0.5)
    return output_projection(cfg, p, o, cos, sin), aux
