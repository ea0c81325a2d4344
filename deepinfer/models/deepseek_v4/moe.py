"""V4 mixture of experts: hash- or score-routed experts plus a shared expert.

Router scores are ``sqrt(softplus(x @ gate.T))`` (or sigmoid). Score layers pick the
top-k of ``score + bias`` (the bias only selects); hash layers take the experts
from the fixed ``tid2eid[token]`` table. The chosen scores are renormalised and
multiplied by ``routed_scaling_factor``. Experts are clamped SwiGLU MLPs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer.config import HASH_MOE, ModelConfig
from deepinfer.models.deepseek_v4.ops import linear, swiglu
from deepinfer.numerics import fixed_sum

# rows [N, in] x per-expert weights [E, out, in] grouped by expert -> [N, out]
_GROUPED_DOT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def route(cfg: ModelConfig, p: dict, mlp_type: str, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, D], token_ids [N] -> (weights [N, k] fp32, experts [N, k] int32)."""
    logits = linear(x, p["weight"]).astype(jnp.float32)
    if cfg.scoring_func == "sqrtsoftplus":
        scores = jnp.sqrt(jax.nn.softplus(logits))
    else:
        scores = jax.nn.sigmoid(logits)
    if mlp_type == HASH_MOE:
        experts = p["tid2eid"][token_ids].astype(jnp.int32)
    else:
        _, experts = lax.top_k(scores + p["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (fixed_sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def routed_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Sum over each token's k experts of weight * expert(x). x [N, D] -> [N, D].

    Three exact formulations, chosen by backend and (static) size:
    * accelerators: grouped matmuls over expert-sorted rows (lax.ragged_dot);
    * CPU, few (token, expert) pairs (decode): gather just the chosen experts' weights;
    * CPU otherwise: every expert on every token, combined with zero weight for
      the unchosen. XLA's CPU ragged_dot costs ~13 ms even for 2 rows (measured
      with 12 experts of 512x512), which made decoding ~30x slower.
    The choice is static (from the token count), so in batch-invariant mode, where the
    block runs in fixed token tiles, every tile takes the same formulation.
    """
    n, k = experts.shape
    if jax.default_backend() != "cpu":
        return _grouped_experts(cfg, p, x, weights, experts)
    if n * k <= cfg.n_routed_experts:
        return _gathered_experts(cfg, p, x, weights, experts)
    return _dense_experts(cfg, p, x, weights, experts)


def _gathered_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    dt = x.dtype
    gate = jnp.einsum("nd,nkid->nki", x, p["w1"][experts].astype(dt))
    up = jnp.einsum("nd,nkid->nki", x, p["w3"][experts].astype(dt))
    out = jnp.einsum("nki,nkdi->nkd", swiglu(gate, up, cfg.swiglu_limit), p["w2"][experts].astype(dt))
    return jnp.einsum("nkd,nk->nd", out, weights.astype(dt))


def _dense_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    dt = x.dtype
    combine = jnp.zeros((x.shape[0], cfg.n_routed_experts), dt)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights.astype(dt))
    gate = jnp.einsum("nd,eid->nei", x, p["w1"].astype(dt))
    up = jnp.einsum("nd,eid->nei", x, p["w3"].astype(dt))
    hidden = swiglu(gate, up, cfg.swiglu_limit)
    out = jnp.einsum("nei,edi->ned", hidden, p["w2"].astype(dt))
    return jnp.einsum("ned,ne->nd", out, combine)


def _grouped_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """(token, expert) pairs sorted by expert; one grouped matmul per projection; scattered back."""
    n, k = experts.shape
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_experts, length=cfg.n_routed_experts).astype(jnp.int32)
    rows = x[token_of]
    gate = lax.ragged_dot_general(rows, p["w1"].astype(x.dtype), group_sizes, _GROUPED_DOT)
    up = lax.ragged_dot_general(rows, p["w3"].astype(x.dtype), group_sizes, _GROUPED_DOT)
    hidden = swiglu(gate, up, cfg.swiglu_limit)
    out = lax.ragged_dot_general(hidden, p["w2"].astype(x.dtype), group_sizes, _GROUPED_DOT)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    return jnp.zeros_like(x).at[token_of].add(out)


def shared_expert(cfg: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    return linear(swiglu(linear(x, p["w1"]), linear(x, p["w3"]), cfg.swiglu_limit), p["w2"])


def moe(cfg: ModelConfig, p: dict, mlp_type: str, x: jax.Array, token_ids: jax.Array) -> jax.Array:
    """x [B, S, D] (normed), token_ids [B, S] -> [B, S, D]."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(cfg, p["gate"], mlp_type, flat, token_ids.reshape(-1))
    out = routed_experts(cfg, p["experts"], flat, weights, experts)
    if "shared" in p:
        out = out + shared_expert(cfg, p["shared"], flat)
    return out.reshape(x.shape)
