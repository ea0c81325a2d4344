"""The CSA lightning indexer over paged indexer rows: scores, then each token's top-k visible rows.

score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) / sqrt(ID) over the token's request rows
(read through its block table); a token keeps the ``k`` best of its first ``n_visible``
rows (all of them when fewer are visible), ties to the lower row, as ``lax.top_k`` does.

``index_select_ref`` is the code the model ran before the kernel (gather every row, one
einsum, ``lax.top_k``). ``index_select`` is a Pallas kernel with one program per token:
it scores the token's rows page by page into its output row, then selects without a
sort (Pallas' GPU lowering has none): the k-th largest score is found by a bitwise
binary search over the scores' order-preserving unsigned keys (32 counting passes),
then the ties at that score are taken from the lowest row by a second binary search
over row indices. Each pass is a masked count over one vector, so it lowers to
Triton's reductions. Per-token programs with a fixed page order: the result does not
depend on the rest of the batch (batch-invariant mode's contract).

GPU lowering: Pallas' Triton backend (per-token vectors and reductions; no MMA-shaped
work worth Mosaic GPU's pipelines at IH = 64 heads). Triton wants power-of-two extents
(heads, index_head_dim, page size, rows per token). Not yet run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer.models.deepseek_v4.indexer import scores_from, select_top_k
from pallas_kernels.sparse_attention import gather_rows


def index_select_ref(q, head_w, pool, table, n_visible, *, k: int, interpret: bool = False):
    """q [T, IH, ID] roped indexer queries; head_w [T, IH] fp32 head weights; pool [pages, page_size, ID]
    the indexer's rows; table [T, max_pages]; n_visible [T] rows closed before each token.
    Returns (selected [T, max_pages * page_size] bool, scores [T, max_pages * page_size] fp32)."""
    rows = gather_rows(pool, table)
    scores = scores_from(q[:, None], rows, head_w[:, None])[:, 0]
    visible = jnp.arange(rows.shape[1])[None, :] < n_visible[:, None]
    return select_top_k(scores, visible, k), scores


def _order_keys(scores: jax.Array, visible: jax.Array) -> jax.Array:
    """fp32 -> uint32 with the same order (negatives: all bits flipped; positives: sign bit set);
    invisible rows get 0, below every score."""
    bits = jax.lax.bitcast_convert_type(scores, jnp.uint32)
    negative = (bits >> 31) == 1
    keys = jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))
    return jnp.where(visible, keys, jnp.uint32(0))


def _top_k_mask(keys: jax.Array, k: int) -> jax.Array:
    """Mask of the k largest keys, ties to the lower index (exactly lax.top_k's set)."""
    count = lambda m: jnp.sum(m.astype(jnp.int32))  # noqa: E731
    tau = jnp.uint32(0)  # the largest value with at least k keys >= it: the k-th largest key
    for bit in range(31, -1, -1):
        cand = tau | jnp.uint32(1 << bit)
        tau = jnp.where(count(keys >= cand) >= k, cand, tau)
    need = k - count(keys > tau)  # >= 1 ties at tau are taken
    ties = keys == tau
    idx = jnp.arange(keys.shape[0])
    last = jnp.int32(0)  # the largest index b with fewer than `need` ties below b: the need-th tie sits at b
    for bit in range(int(keys.shape[0]).bit_length(), -1, -1):
        cand = last | (1 << bit)
        last = jnp.where(count(ties & (idx < cand)) < need, cand, last)
    return (keys > tau) | (ties & (idx <= last))


def _kernel(nvis_ref, q_ref, w_ref, table_ref, pool_ref, sel_ref, score_ref, *, k, num_pages, page_size):
    qf = q_ref[0].astype(jnp.float32)
    w = w_ref[0].astype(jnp.float32)
    scale = qf.shape[-1] ** -0.5

    def page(j, _):
        rows = pool_ref[table_ref[0, j]].astype(jnp.float32)
        dots = jax.nn.relu(jnp.dot(qf, rows.T, preferred_element_type=jnp.float32)) * scale
        score_ref[0, pl.ds(j * page_size, page_size)] = jnp.sum(dots * w[:, None], axis=0)
        return 0

    jax.lax.fori_loop(0, num_pages, page, 0)
    n_rows = num_pages * page_size
    visible = jnp.arange(n_rows) < nvis_ref[0, 0]
    if k >= n_rows:
        chosen = visible
    else:
        chosen = _top_k_mask(_order_keys(score_ref[0], visible), k) & visible
    sel_ref[0] = chosen.astype(jnp.int32)


def index_select(q, head_w, pool, table, n_visible, *, k: int, interpret: bool = False):
    """The Pallas kernel of index_select_ref (same arguments; scores equal up to fp32 rounding, and the
    selection is the top-k of the kernel's own scores)."""
    t_count, heads, dim = q.shape
    num_pages, page_size = table.shape[1], pool.shape[1]
    n_rows = num_pages * page_size
    table = jnp.clip(table, 0, pool.shape[0] - 1).astype(jnp.int32)
    nvis = n_visible.astype(jnp.int32)[:, None]
    per_token = lambda a: pl.BlockSpec((1, *a.shape[1:]), lambda t: (t,) + (0,) * (a.ndim - 1))  # noqa: E731
    kernel = functools.partial(_kernel, k=k, num_pages=num_pages, page_size=page_size)
    sel, scores = pl.pallas_call(
        kernel,
        grid=(t_count,),
        in_specs=[per_token(nvis), per_token(q), per_token(head_w), per_token(table),
                  pl.BlockSpec(pool.shape, lambda t: (0, 0, 0))],
        out_specs=[pl.BlockSpec((1, n_rows), lambda t: (t, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((t_count, n_rows), jnp.int32),
                   jax.ShapeDtypeStruct((t_count, n_rows), jnp.float32)],
        interpret=interpret,
    )(nvis, q, head_w, table, pool)
    return sel > 0, scores
