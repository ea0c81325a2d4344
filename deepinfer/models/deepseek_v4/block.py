"""One V4 decoder block over hyper-connection streams: attention then MoE, each wrapped in mHC."""

from __future__ import annotations

from typing import Callable

import jax

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.hyper_connections import hc_post, hc_pre
from deepinfer.models.deepseek_v4.moe import moe
from deepinfer.models.deepseek_v4.ops import rms_norm
from deepinfer.numerics import per_token_2d

# normed attention input [B, S, D] -> (output [B, S, D], intermediates)
AttentionFn = Callable[[jax.Array], tuple[jax.Array, dict]]


def block(
    cfg: ModelConfig,
    p: dict,
    mlp_type: str,
    streams: jax.Array,
    token_ids: jax.Array,
    attention_fn: AttentionFn,
) -> tuple[jax.Array, dict]:
    """streams [B, S, hc, D] -> new streams, plus intermediates keyed by sub-layer.

    ``attention_fn`` runs the attention sub-layer (whole-sequence or cached; it
    closes over positions and cache state). token_ids [B, S] feed hash routing.
    Intermediates (dropped by XLA when unused): "attn_in" / "ffn_in" — the
    collapsed, normed sub-layer inputs; "attn" / "moe" — sub-layer outputs;
    "moe.experts" — the routed experts [B, S, k]; "attn.*" — attention internals; "out" — the new streams.
    """
    eps = cfg.rms_norm_eps
    tiled = cfg.batch_invariant  # per-token work in fixed token tiles (numerics.token_tiled)

    def attn_input(streams):
        post, comb, collapsed = hc_pre(cfg, p["hc_attn"], streams)
        return post, comb, rms_norm(collapsed, p["attn_norm"], eps)

    def ffn(post, comb, attn_out, streams, token_ids):
        streams = hc_post(post, comb, attn_out, streams)
        post, comb, collapsed = hc_pre(cfg, p["hc_ffn"], streams)
        ffn_in = rms_norm(collapsed, p["ffn_norm"], eps)
        moe_out, experts = moe(cfg, p["ffn"], mlp_type, ffn_in, token_ids)
        return hc_post(post, comb, moe_out, streams), ffn_in, moe_out, experts

    post, comb, attn_in = per_token_2d(tiled, attn_input, streams)
    attn_out, attn_aux = attention_fn(attn_in)
    streams, ffn_in, moe_out, experts = per_token_2d(tiled, ffn, post, comb, attn_out, streams, token_ids)

    aux = {"attn_in": attn_in, "attn": attn_out, "ffn_in": ffn_in, "moe": moe_out, "moe.experts": experts,
           "out": streams}
    aux.update({f"attn.{k}": v for k, v in attn_aux.items()})
    return streams, aux
