"""Manifold-constrained hyper-connections (mHC).

The residual is ``hc`` parallel streams ``[..., hc, D]``. Before each sub-layer an
RMS-scaled projection of the flattened streams gives ``pre`` (collapse weights),
``post`` (expand weights) and a ``comb`` matrix made doubly stochastic by Sinkhorn
iterations. After the sub-layer: ``new[k] = post[k] * out + sum_j comb[j, k] * old[j]``
(comb is applied transposed). The model's head collapses with its own ``pre`` only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.ops import unweighted_rms_norm
from deepinfer.numerics import fixed_softmax, fixed_sum


def _mix_logits(streams: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """[..., hc, D] -> [..., n_out] in fp32: RMS-normalised flattened streams times fn.T."""
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    flat = unweighted_rms_norm(flat, eps)
    return jnp.einsum("...k,nk->...n", flat, fn.astype(jnp.float32))


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax, then alternate column / row normalisation (column first and last)."""
    comb = fixed_softmax(logits, axis=-1) + eps
    comb = comb / (fixed_sum(comb, axis=-2, keepdims=True) + eps)

    def row_then_column(_, c):
        c = c / (fixed_sum(c, axis=-1, keepdims=True) + eps)
        return c / (fixed_sum(c, axis=-2, keepdims=True) + eps)

    # A loop, not an unrolled chain: 20 iterations x every hc site otherwise doubles compile time.
    return jax.lax.fori_loop(0, iters - 1, row_then_column, comb)


def hc_pre(cfg: ModelConfig, p: dict, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mixing weights for one sub-layer, and the collapsed sub-layer input.

    streams: [..., hc, D]. Returns post [..., hc] and comb [..., hc, hc] (fp32) and
    collapsed [..., D] in the streams' dtype.
    """
    hc = cfg.hc_mult
    mix = _mix_logits(streams, p["fn"], cfg.rms_norm_eps)
    pre_w, post_w, comb_w = mix[..., :hc], mix[..., hc : 2 * hc], mix[..., 2 * hc :]
    base, scale = p["base"], p["scale"]
    pre = jax.nn.sigmoid(pre_w * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * jax.nn.sigmoid(post_w * scale[1] + base[hc : 2 * hc])
    comb_logits = comb_w.reshape(*comb_w.shape[:-1], hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
    comb = sinkhorn(comb_logits, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    collapsed = fixed_sum(pre[..., None] * streams.astype(jnp.float32), axis=-2).astype(streams.dtype)
    return post, comb, collapsed


def hc_post(post: jax.Array, comb: jax.Array, out: jax.Array, streams: jax.Array) -> jax.Array:
    """new[..., k, :] = post[k] * out + sum_j comb[j, k] * streams[j], in the streams' dtype."""
    dtype = streams.dtype
    # A [hc, hc] x [hc, D] product per token, written as products summed in a fixed order:
    # as an einsum, XLA rewrites it into a reduce whose rounding follows the token count.
    mixed = fixed_sum(comb.astype(dtype)[..., :, :, None] * streams[..., :, None, :], axis=-3)
    return post.astype(dtype)[..., None] * out[..., None, :] + mixed


def hc_head(cfg: ModelConfig, p: dict, streams: jax.Array) -> jax.Array:
    """Final collapse of the streams [..., hc, D] -> [..., D] (sigmoid weights, no Sinkhorn)."""
    mix = _mix_logits(streams, p["fn"], cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(mix * p["scale"][0] + p["base"]) + cfg.hc_eps
    return fixed_sum(pre[..., None] * streams.astype(jnp.float32), axis=-2).astype(streams.dtype)
