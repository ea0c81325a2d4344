"""The multi-token-prediction (MTP) block: predicts token t+2 from position t.

Inputs are the main model's pre-head streams at t and the embedding of token
t+1. Each is RMS-normed (the streams per stream), projected (``e_proj``,
``h_proj``), and summed — the embedding broadcast over the hc streams. One full
decoder block follows (its attention type from the config; sliding-only in
released V4 models; score-routed MoE), then the MTP's own hyper-connection head
and norm, and the main model's shared lm head. The transformers reference drops
MTP weights, so tests check this against an independent reference.
"""

from __future__ import annotations

import functools

import jax

from deepinfer.config import SCORE_MOE, ModelConfig
from deepinfer.models.deepseek_v4.attention import attention
from deepinfer.models.deepseek_v4.block import block
from deepinfer.models.deepseek_v4.model import embed, lm_head
from deepinfer.models.deepseek_v4.ops import linear, rms_norm


def mtp_forward(
    cfg: ModelConfig,
    params: dict,
    depth: int,
    streams: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """MTP depth ``depth`` over whole sequences.

    streams [B, S, hc, D]: the main model's pre-head streams (or the previous
    depth's output); next_tokens [B, S]: token t+1 for each position t;
    positions [B, S]. Returns (logits [B, S, V] fp32 for token t+2, output streams).
    """
    p = params["mtp"][depth]
    eps = cfg.rms_norm_eps
    e = rms_norm(embed(params, next_tokens), p["enorm"], eps)
    h = rms_norm(streams, p["hnorm"], eps)
    x = linear(e, p["e_proj"])[:, :, None, :] + linear(h, p["h_proj"])
    attn_fn = functools.partial(attention, cfg, p["block"]["attn"], cfg.mtp_layer_types[depth], positions=positions)
    x, _ = block(cfg, p["block"], SCORE_MOE, x, next_tokens, attn_fn)
    return lm_head(cfg, params, p["hc_head"], p["norm"], x), x
