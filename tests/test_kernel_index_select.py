"""The CSA indexer kernel (scores + top-k over paged rows) against its reference, in interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.models.deepseek_v4.indexer import select_top_k
from pallas_kernels.index_select import (
    _order_keys,
    _top_k_mask,
    index_select,
    index_select_ref,
)
from tests.kernel_batches import INTERPRET, ragged_batch

IH, ID, PAGE, PAGES = 4, 16, 4, 6


def _inputs(dtype, seed=0, **batch):
    fb, table = ragged_batch(max_pages=PAGES, **batch)
    t = fb.positions.shape[0]
    k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k[0], (t, IH, ID), jnp.float32).astype(dtype)
    head_w = jax.random.normal(k[1], (t, IH), jnp.float32)
    pool = jax.random.normal(k[2], (40, PAGE, ID), jnp.float32).astype(dtype)
    n_visible = (fb.positions + 1) // 4  # CSA ratio 4: rows closed at or before each token
    return (q, head_w, pool, table, n_visible), np.asarray(fb.valid)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 3, 7, PAGES * PAGE, 100], ids=lambda k: f"k{k}")
def test_matches_reference(dtype, k):
    """Scores close to the reference's; the selection is exactly the top-k of the kernel's scores
    (the reference's rule applied to them), and equal to the reference's where no near-tie decides.
    k covers 1, more than some rows have visible (a row with 0 visible rows included), all rows,
    and more rows than exist."""
    args, valid = _inputs(dtype)
    sel, scores = index_select(*args, k=k, interpret=INTERPRET)
    ref_sel, ref_scores = index_select_ref(*args, k=k)
    visible = np.arange(PAGES * PAGE)[None, :] < np.asarray(args[4])[:, None]
    np.testing.assert_allclose(np.asarray(scores)[visible & valid[:, None]],
                               np.asarray(ref_scores)[visible & valid[:, None]], rtol=1e-5, atol=1e-5)
    own_rule = select_top_k(scores, jnp.asarray(visible), k)
    np.testing.assert_array_equal(np.asarray(sel)[valid], np.asarray(own_rule)[valid])
    np.testing.assert_array_equal(np.asarray(sel)[valid], np.asarray(ref_sel)[valid])
    assert np.asarray(sel).sum(axis=1).max() == min(k, visible.sum(axis=1).max())


def test_ties_go_to_the_lower_row():
    keys = _order_keys(jnp.asarray([1.0, 3.0, 2.0, 3.0, 3.0, -1.0, 2.0, 0.0]), jnp.ones(8, bool))
    for k in range(1, 9):
        expect = select_top_k(jnp.asarray([1.0, 3.0, 2.0, 3.0, 3.0, -1.0, 2.0, 0.0]), jnp.ones(8, bool), k)
        np.testing.assert_array_equal(np.asarray(_top_k_mask(keys, k)), np.asarray(expect), err_msg=f"k={k}")


def test_order_keys_keep_the_float_order():
    x = jnp.asarray([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf], jnp.float32)
    keys = np.asarray(_order_keys(x, jnp.ones(8, bool))).astype(np.int64)
    assert (np.diff(keys) >= 0).all() and keys[0] > 0  # invisible rows (0) stay below -inf


def test_catches_a_wrong_visibility():
    """The comparison has teeth: one more visible row per token changes the selection."""
    args, valid = _inputs(jnp.float32)
    wrong, _ = index_select(*args[:4], args[4] + 1, k=3, interpret=INTERPRET)
    ref, _ = index_select_ref(*args, k=3)
    assert (np.asarray(wrong)[valid] != np.asarray(ref)[valid]).any()
