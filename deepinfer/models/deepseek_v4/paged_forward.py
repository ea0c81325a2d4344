"""V4's incremental forward over a flat token batch: the engine step's model part.

The same decoder blocks as the whole-sequence forward (model.run_layers), with each
layer's attention reading and writing the engine state (paged_attention.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.model import lm_head, run_layers
from deepinfer.models.deepseek_v4.paged_attention import paged_attention
from deepinfer.models.interface import FlatBatch


def paged_forward(
    cfg: ModelConfig, params: dict, state: dict, tokens: jax.Array, fb: FlatBatch, page_size: int
) -> tuple[jax.Array, dict]:
    """tokens [T] -> (pre-head streams [T, hc, D], new state); the MTP state (if any) is left as it is."""

    def attention_for(i, layer_type, p):
        def fn(x):  # the flat batch is one row of T tokens
            x = cfg.sharding.split_tokens(x, 1) if cfg.sharding is not None else x  # context parallel: by token
            y, new_st = paged_attention(cfg, p, layer_type, state["layers"][i], x[0], fb, page_size)
            y = cfg.sharding.split_tokens(y, 0) if cfg.sharding is not None else y
            return y[None], {"state": new_st}

        return fn

    plan = cfg.sharding
    if plan is not None and plan.context_parallel_size > 1:
        # context parallel: the token ids and the batch's index fields stay whole on every device (only the
        # activations are split), so per-token bookkeeping never becomes a distributed gather / scatter
        tokens, fb = jax.lax.with_sharding_constraint((tokens, fb), plan.replicated())
    streams, layers_aux = run_layers(cfg, params, tokens[None], attention_for)
    new_state = {**state, "layers": [aux["attn.state"] for aux in layers_aux]}
    if "expert_load" in state:  # EPLB: tokens routed to each expert, per layer, since the engine reset it
        routed = jnp.stack([aux["moe.experts"][0] for aux in layers_aux])  # [L, T, k]
        counted = jnp.where(fb.valid[None, :, None], routed, cfg.n_routed_experts)  # padding: out of range
        layer = jnp.arange(routed.shape[0])[:, None, None]
        added = jnp.zeros_like(state["expert_load"]).at[layer, counted].add(1, mode="drop")
        if plan is not None and plan.in_data_parallel_step():  # each rank counted its own tokens
            added = jax.lax.psum(added, "dp")
        new_state["expert_load"] = state["expert_load"] + added
    return streams[0], new_state


def logits(cfg: ModelConfig, params: dict, streams: jax.Array) -> jax.Array:
    """Pre-head streams [..., hc, D] -> logits [..., V] fp32 (hc head, norm, lm head)."""
    return lm_head(cfg, params, params["hc_head"], params["norm"], streams)
