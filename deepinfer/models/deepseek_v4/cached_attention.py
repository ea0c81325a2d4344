"""V4 attention for a chunk of new tokens per sequence, reading and updating the decode state.

Keys are the window ring as it was before the chunk, the chunk's own KV, and the
compressed row store (rows closing inside the chunk included). Masks come from
absolute positions, so prefill chunks of any size and single decode tokens run
the same code, and sequences in a batch may sit at different lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.config import CSA, HCA, ModelConfig
from deepinfer.kv.ring import ring_positions, ring_write
from deepinfer.models.deepseek_v4 import indexer
from deepinfer.models.deepseek_v4.attention import (
    attend_with_sink,
    output_projection,
    query_and_kv,
    rope_for,
)
from deepinfer.models.deepseek_v4.cached_compressor import extend_compressor
from deepinfer.models.deepseek_v4.compressor import visible_rows
from deepinfer.models.deepseek_v4.rope import rope_angles


def cached_attention(
    cfg: ModelConfig,
    p: dict,
    layer_type: str,
    st: dict,
    x: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    n_valid: jax.Array,
) -> tuple[jax.Array, dict]:
    """x [B, C, D] normed chunk input; positions [B, C] = lengths[:, None] + arange(C);
    n_valid [B]. Returns the output [B, C, D] and the layer's new state."""
    cos, sin = rope_angles(rope_for(cfg, layer_type), cfg.qk_rope_head_dim, positions)
    q_latent, q, kv = query_and_kv(cfg, p, x, cos, sin)
    valid = jnp.arange(x.shape[1])[None, :] < n_valid[:, None]

    ring = st["window"]
    ring_pos = ring_positions(lengths, ring.shape[1])
    key_pos = jnp.concatenate([ring_pos, positions], axis=1)
    key_ok = jnp.concatenate([ring_pos >= 0, valid], axis=1)
    dist = positions[:, :, None] - key_pos[:, None, :]
    mask = (dist >= 0) & (dist < cfg.sliding_window) & key_ok[:, None, :]
    keys = jnp.concatenate([ring, kv.astype(ring.dtype)], axis=1)
    new_st = {"window": ring_write(ring, kv, positions, n_valid)}

    if layer_type in (CSA, HCA):
        ratio = cfg.compress_ratio(layer_type)
        main = extend_compressor(
            cfg, p["compressor"], st, x, positions, lengths, n_valid, ratio, cfg.head_dim, overlap=layer_type == CSA
        )
        new_st.update(main)
        visible = visible_rows(positions, main["rows"].shape[1], ratio)
        if layer_type == CSA:
            ip = p["indexer"]
            idx = extend_compressor(
                cfg, ip["compressor"], st["indexer"], x, positions, lengths, n_valid, ratio, cfg.index_head_dim, overlap=True
            )
            new_st["indexer"] = idx
            iq = indexer.index_queries(cfg, ip, q_latent, cos, sin)
            scores = indexer.index_scores(cfg, ip, x, iq, idx["rows"])
            visible = indexer.select_top_k(scores, visible, cfg.index_topk)
        keys = jnp.concatenate([keys, main["rows"].astype(keys.dtype)], axis=1)
        mask = jnp.concatenate([mask, visible], axis=-1)

    o = attend_with_sink(q, keys, mask, p["sink"], cfg.head_dim**-0.5)
    return output_projection(cfg, p, o, cos, sin), new_st
