"""The V4 forward for a chunk of new tokens per sequence, over a decode state.

``extend`` is the one step function behind chunked prefill and decoding: each
sequence b appends ``n_valid[b]`` tokens (the rest of its row in ``tokens`` is
padding) at positions ``lengths[b] ...``. Logits for committed positions equal
the whole-sequence forward's.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.block import block
from deepinfer.models.deepseek_v4.cached_attention import cached_attention
from deepinfer.models.deepseek_v4.model import embed, lm_head


def _attention_into(out: dict, key: int, cfg, p, layer_type, st, positions, lengths, n_valid):
    """An attention_fn for block() that stashes the layer's new state in out[key]."""

    def fn(x):
        y, new_st = cached_attention(cfg, p, layer_type, st, x, positions, lengths, n_valid)
        out[key] = new_st
        return y, {}

    return fn


def extend(
    cfg: ModelConfig, params: dict, state: dict, tokens: jax.Array, n_valid: jax.Array, all_logits: bool = True
) -> tuple[jax.Array, dict]:
    """Append tokens [B, C] (n_valid [B] real ones each) to the sequences in ``state``.

    Returns logits — [B, C, V] for every chunk token if ``all_logits`` else [B, V]
    at each sequence's last real token (meaningless where n_valid is 0) — and the
    new state. Padding tokens change nothing.
    """
    lengths = state["lengths"]
    n_valid = n_valid.astype(jnp.int32)
    positions = lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    h = embed(params, tokens)
    streams = jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], cfg.hc_mult, h.shape[-1]))
    new_layers: dict[int, dict] = {}
    for i, (layer_type, mlp_type) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        p = params["layers"][i]
        fn = _attention_into(new_layers, i, cfg, p["attn"], layer_type, state["layers"][i], positions, lengths, n_valid)
        streams, _ = block(cfg, p, mlp_type, streams, tokens, fn)
    if not all_logits:
        last = jnp.maximum(n_valid - 1, 0)
        streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)[:, 0]
    logits = lm_head(cfg, params, params["hc_head"], params["norm"], streams)
    new_state = {
        "lengths": lengths + n_valid,
        "high_water": jnp.maximum(state["high_water"], lengths + n_valid),
        "layers": [new_layers[i] for i in range(cfg.num_hidden_layers)],
    }
    return logits, new_state
