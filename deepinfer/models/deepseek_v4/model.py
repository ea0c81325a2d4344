"""The DeepSeek-V4 forward pass over whole sequences (no cache).

``forward(cfg, params, tokens)`` -> logits. ``forward_with_intermediates`` also
returns every block's intermediates and the pre-head streams (what the MTP block
consumes). Under jit, intermediates nobody reads are removed by XLA.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.attention import attention
from deepinfer.models.deepseek_v4.block import AttentionFn, block
from deepinfer.models.deepseek_v4.hyper_connections import hc_head
from deepinfer.models.deepseek_v4.ops import einsum_f32, rms_norm
from deepinfer.models.deepseek_v4.weight_layout import InOut


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    """tokens [B, S] -> [B, S, D] in the embedding's dtype."""
    return params["embed"][tokens]


def lm_head(cfg: ModelConfig, params: dict, head_params: dict, norm_w: jax.Array, streams: jax.Array) -> jax.Array:
    """Collapse streams with a hyper-connection head, norm, project to the vocabulary (fp32 logits)."""
    x = rms_norm(hc_head(cfg, head_params, streams), norm_w, cfg.rms_norm_eps)
    w = params["embed"] if cfg.tie_word_embeddings else params["head"]
    if isinstance(w, InOut):  # stored [D, V] (weight_layout.py)
        logits = einsum_f32("...d,dv->...v", x, w.t.astype(x.dtype))
    else:
        logits = einsum_f32("...d,vd->...v", x, w.astype(x.dtype))
    if cfg.sharding is not None:
        # each device its slice of the vocabulary, then the logits whole on every device (one all-gather
        # of [.., V]). Left split, the sampler's top-k and sorts became distributed sorts (84
        # collective-permutes in a decode step); asked whole at once, XLA gathered the head weight instead
        plan = cfg.sharding
        split = jax.sharding.PartitionSpec(*(None,) * (logits.ndim - 1), plan.rules.get("vocab"))
        logits = jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(plan.context_mesh(), split))
        logits = jax.lax.with_sharding_constraint(logits, plan.replicated())
    return logits


def default_positions(tokens: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def run_layers(
    cfg: ModelConfig, params: dict, tokens: jax.Array, attention_for: Callable[[int, str, dict], AttentionFn]
) -> tuple[jax.Array, list[dict]]:
    """Embed tokens [B, S] into hc streams and run every decoder block.

    ``attention_for(i, layer_type, attn_params)`` gives layer i's attention
    sub-layer (whole-sequence, cached or paged); a stateful one returns its new
    layer state as the intermediate "state" (block() exposes it as "attn.state").
    Returns the pre-head streams [B, S, hc, D] and per-layer intermediates.
    """
    h = embed(params, tokens)
    streams = jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], cfg.hc_mult, h.shape[-1]))
    layers_aux = []
    for i, (layer_type, mlp_type) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        p = params["layers"][i]
        streams, aux = block(cfg, p, mlp_type, streams, tokens, attention_for(i, layer_type, p["attn"]))
        layers_aux.append(aux)
    return streams, layers_aux


def forward_with_intermediates(cfg: ModelConfig, params: dict, tokens: jax.Array) -> tuple[jax.Array, jax.Array, list[dict]]:
    """tokens [B, S] (whole sequences from position 0) -> (logits [B, S, V] fp32,
    pre-head streams [B, S, hc, D], per-layer intermediates)."""
    positions = default_positions(tokens)
    streams, layers_aux = run_layers(
        cfg, params, tokens, lambda i, lt, p: functools.partial(attention, cfg, p, lt, positions=positions)
    )
    logits = lm_head(cfg, params, params["hc_head"], params["norm"], streams)
    return logits, streams, layers_aux


def forward(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """tokens [B, S] -> logits [B, S, V] (fp32)."""
    return forward_with_intermediates(cfg, params, tokens)[0]
