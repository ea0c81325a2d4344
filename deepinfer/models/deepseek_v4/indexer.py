"""The lightning indexer of CSA layers: which compressed rows each query attends to.

score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) / sqrt(index_head_dim), with
w = weights_proj(x) / sqrt(index_n_heads), q from the shared low-rank query and
k the indexer's own compressed rows. Each query keeps the ``index_topk`` best of
its visible rows (all of them when fewer are visible).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.ops import linear
from deepinfer.models.deepseek_v4.rope import apply_rope


def index_queries(cfg: ModelConfig, p: dict, q_latent: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """q_latent [B, S, q_lora] -> roped indexer queries [B, S, IH, ID] (compress rope at the token positions)."""
    q = linear(q_latent, p["wq_b"])
    q = q.reshape(*q.shape[:-1], cfg.index_n_heads, cfg.index_head_dim)
    return apply_rope(q, cos, sin)


def head_weights(cfg: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """x [..., D] -> each indexer head's weight [..., IH] (fp32)."""
    return linear(x, p["weights_proj"]).astype(jnp.float32) * cfg.index_n_heads**-0.5


def scores_from(q: jax.Array, keys: jax.Array, head_w: jax.Array) -> jax.Array:
    """q [B, S, IH, ID], keys [B, T, ID], head_w [B, S, IH] -> scores [B, S, T] (fp32)."""
    dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), keys.astype(jnp.float32))
    dots = jax.nn.relu(dots) * q.shape[-1] ** -0.5
    return jnp.einsum("bsht,bsh->bst", dots, head_w)


def index_scores(cfg: ModelConfig, p: dict, x: jax.Array, q: jax.Array, keys: jax.Array) -> jax.Array:
    """x [B, S, D], q [B, S, IH, ID], keys [B, T, ID] -> scores [B, S, T] (fp32)."""
    return scores_from(q, keys, head_weights(cfg, p, x))


def select_top_k(scores: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """Mask [..., T] of the top-k visible rows per query (fewer when fewer are visible)."""
    n_rows = scores.shape[-1]
    k = min(k, n_rows)
    if k == n_rows:
        return visible
    masked = jnp.where(visible, scores, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    chosen = jnp.sum(jax.nn.one_hot(idx, n_rows, dtype=jnp.int32), axis=-2) > 0
    return chosen & visible
