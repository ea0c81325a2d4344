"""The MoE grouped matmuls over expert-sorted rows, with V4's clamped SwiGLU fused into the first.

Rows arrive sorted by expert (``group_sizes[e]`` consecutive rows for expert e; rows
past the sum belong to no expert and come out zero, as with ``lax.ragged_dot``).

* ``grouped_swiglu(rows, w1, w3, group_sizes)``: ``swiglu(rows @ w1[e].T, rows @ w3[e].T)``
  per row, the gate and up projections and the clamp in one pass (the [N, I]
  gate and up never go to memory);
* ``grouped_matmul(hidden, w2, group_sizes)``: ``hidden @ w2[e].T`` per row.

The ``_ref`` twins are what the model ran before (``lax.ragged_dot_general``, then
``swiglu``). The kernels run one program per (row tile, output tile); a tile may
straddle experts, so each program loops over the experts its rows belong to
(from the group offsets; an expert owning none of the tile's rows is skipped without
reading its weights) and keeps each row's product with its own expert only (the
others add exact zeros). Tiles are fixed sizes and each output element
is one dot over the whole input dimension, so a row's result does not depend on
which other rows share its step: batch-invariant mode's contract holds.

GPU lowering: Pallas' Triton backend (tiles of rows x output columns with a dot
per expert are Triton's matmul shape; Mosaic GPU's wgmma pipelines are the
Hopper upgrade for prefill-sized groups). Triton wants power-of-two tiles; the
tile sizes here are, and V4-Flash's hidden (4096) and expert width (2048) divide by
them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deepinfer.models.deepseek_v4.ops import swiglu

# rows [N, in] x per-expert weights [E, out, in] grouped by expert -> [N, out]
_GROUPED_DOT = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)
TILE_ROWS = 16
TILE_COLS = 128
TILE_K = 256  # input-dimension chunk of one dot (fixed: the reduction order never depends on the batch)


def grouped_swiglu_ref(rows, w1, w3, group_sizes, *, limit: float, interpret: bool = False):
    """rows [N, D], w1/w3 [E, I, D], group_sizes [E] -> swiglu(gate, up) [N, I] in rows' dtype."""
    gate = lax.ragged_dot_general(rows, w1.astype(rows.dtype), group_sizes, _GROUPED_DOT)
    up = lax.ragged_dot_general(rows, w3.astype(rows.dtype), group_sizes, _GROUPED_DOT)
    return swiglu(gate, up, limit)


def grouped_matmul_ref(rows, w, group_sizes, *, interpret: bool = False):
    """rows [N, I], w [E, D, I], group_sizes [E] -> [N, D] in rows' dtype."""
    return lax.ragged_dot_general(rows, w.astype(rows.dtype), group_sizes, _GROUPED_DOT)


def _tile_experts(group_sizes, n_pad: int, tile: int):
    """Per row tile: [first expert, last expert] whose rows it holds, and every expert's [start, end)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    lo = jnp.arange(0, n_pad, tile, dtype=jnp.int32)
    first = jnp.searchsorted(ends, lo, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, lo + tile - 1, side="right").astype(jnp.int32)
    last = jnp.minimum(last, group_sizes.shape[0] - 1)  # rows past every group: no expert, an empty loop
    span = jnp.stack([first, last], axis=1)
    return span, jnp.stack([starts, ends], axis=1)


def _expert_products(span_ref, bounds_ref, x_ref, weights, tile_rows, tile_cols):
    """For one (row tile, column tile): each row's x @ w[e].T with its own expert e, for every w in weights.

    Experts between the tile's first and last that own none of its rows are skipped (no weight
    read: a decode tile's few rows may name experts far apart). The input dimension is read in
    fixed TILE_K chunks, always in the same order, so a row's sums never depend on the batch."""
    i, j = pl.program_id(0), pl.program_id(1)
    lo = i * tile_rows
    row = lo + jnp.arange(tile_rows)
    wdt = x_ref.dtype  # weights rounded to the rows' dtype first, as the reference's ragged dots take them
    d_in = x_ref.shape[1]
    tile_k = min(TILE_K, d_in)

    def one_expert(e, accs):
        start, end = bounds_ref[e, 0], bounds_ref[e, 1]
        mine = (row >= start) & (row < end)

        def products(accs):
            def k_chunk(c, sums):
                xk = x_ref[:, pl.ds(c * tile_k, tile_k)].astype(jnp.float32)
                out = []
                for acc, w_ref in zip(sums, weights):
                    w = w_ref[e, pl.ds(j * tile_cols, tile_cols), pl.ds(c * tile_k, tile_k)]
                    out.append(acc + jnp.dot(xk, w.astype(wdt).astype(jnp.float32).T,
                                             preferred_element_type=jnp.float32))
                return tuple(out)

            zeros = tuple(jnp.zeros((tile_rows, tile_cols), jnp.float32) for _ in weights)
            prods = lax.fori_loop(0, d_in // tile_k, k_chunk, zeros)
            return tuple(acc + jnp.where(mine[:, None], prod, 0.0) for acc, prod in zip(accs, prods))

        owns_rows_here = (end > start) & (end > lo) & (start < lo + tile_rows)
        return lax.cond(owns_rows_here, products, lambda accs: accs, accs)

    zeros = tuple(jnp.zeros((tile_rows, tile_cols), jnp.float32) for _ in weights)
    return lax.fori_loop(span_ref[i, 0], span_ref[i, 1] + 1, one_expert, zeros)


def _swiglu_kernel(span_ref, bounds_ref, x_ref, w1_ref, w3_ref, out_ref, *, limit, tile_rows, tile_cols):
    gate, up = _expert_products(span_ref, bounds_ref, x_ref, (w1_ref, w3_ref), tile_rows, tile_cols)
    # the products are rounded to the rows' dtype before the clamp, as the reference's ragged dots are
    dt = out_ref.dtype
    out_ref[...] = swiglu(gate.astype(dt), up.astype(dt), limit).astype(dt)


def _matmul_kernel(span_ref, bounds_ref, x_ref, w_ref, out_ref, *, tile_rows, tile_cols):
    (out,) = _expert_products(span_ref, bounds_ref, x_ref, (w_ref,), tile_rows, tile_cols)
    out_ref[...] = out.astype(out_ref.dtype)


def _grouped_call(kernel, rows, weights, group_sizes, interpret):
    n, d_in = rows.shape
    d_out = weights[0].shape[1]
    tile_cols = min(TILE_COLS, d_out)
    if d_out % tile_cols or d_in % min(TILE_K, d_in):
        raise ValueError(f"grouped matmul: widths {d_in} -> {d_out} are not multiples of the tiles "
                         f"({min(TILE_K, d_in)} in, {tile_cols} out)")
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    x = jnp.pad(rows, ((0, n_pad - n), (0, 0)))
    span, bounds = _tile_experts(group_sizes, n_pad, TILE_ROWS)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731  (indexed in the kernel)
    out = pl.pallas_call(
        functools.partial(kernel, tile_rows=TILE_ROWS, tile_cols=tile_cols),
        grid=(n_pad // TILE_ROWS, d_out // tile_cols),
        in_specs=[whole(span), whole(bounds), pl.BlockSpec((TILE_ROWS, d_in), lambda i, j: (i, 0))]
        + [whole(w) for w in weights],
        out_specs=pl.BlockSpec((TILE_ROWS, tile_cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_pad, d_out), rows.dtype),
        interpret=interpret,
    )(span, bounds, x, *weights)
    return out[:n]


def grouped_swiglu(rows, w1, w3, group_sizes, *, limit: float, interpret: bool = False):
    """The Pallas kernel of grouped_swiglu_ref (same arguments, same result up to fp32 rounding)."""
    kernel = functools.partial(_swiglu_kernel, limit=limit)
    return _grouped_call(kernel, rows, (w1, w3), group_sizes, interpret)


def grouped_matmul(rows, w, group_sizes, *, interpret: bool = False):
    """The Pallas kernel of grouped_matmul_ref (same arguments, same result up to fp32 rounding)."""
    return _grouped_call(_matmul_kernel, rows, (w,), group_sizes, interpret)
