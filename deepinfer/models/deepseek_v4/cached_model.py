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
from deepinfer.models.deepseek_v4.cached_attention import cached_attention
from deepinfer.models.deepseek_v4.model import lm_head, run_layers


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

    def attention_for(i, layer_type, p):
        def fn(x):
            y, new_st = cached_attention(cfg, p, layer_type, state["layers"][i], x, positions, lengths, n_valid)
            return y, {"state": new_st}

        return fn

    streams, layers_aux = run_layers(cfg, params, tokens, attention_for)
    if not all_logits:
        last = jnp.maximum(n_valid - 1, 0)
        streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)[:, 0]
    logits = lm_head(cfg, params, params["hc_head"], params["norm"], streams)
    new_state = {
        "lengths": lengths + n_valid,
        "high_water": jnp.maximum(state["high_water"], lengths + n_valid),
        "layers": [aux["attn.state"] for aux in layers_aux],
    }
    return logits, new_state
