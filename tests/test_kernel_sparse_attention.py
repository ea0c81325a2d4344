"""The paged sparse attention kernel against its pure-JAX reference, in Pallas interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attention import sparse_attention, sparse_attention_ref
from tests.kernel_batches import INTERPRET, ROWS, ragged_batch

HEADS, HD, WINDOW, KEEP, PAGE, PAGES = 4, 16, 8, 10, 4, 6


def _inputs(dtype, compressed=True, seed=0, **batch):
    fb, table = ragged_batch(max_pages=PAGES, **batch)
    t = fb.positions.shape[0]
    k = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(k[0], (t, HEADS, HD), jnp.float32).astype(dtype)
    kv = jax.random.normal(k[1], (t, HD), jnp.float32).astype(dtype)
    ring = jax.random.normal(k[2], (4, KEEP, HD), jnp.float32).astype(dtype)
    sink = jax.random.normal(k[3], (HEADS,), jnp.float32)
    pool = table_ = selected = None
    if compressed:
        pool = jax.random.normal(k[4], (40, PAGE, HD), jnp.float32).astype(dtype)
        # HCA-like visibility (every closed row of ratio 4) thinned at random like a top-k would
        visible = np.arange(PAGES * PAGE)[None, :] < ((np.asarray(fb.positions) + 1) // 4)[:, None]
        keep = np.random.default_rng(seed).random(visible.shape) < 0.6
        selected, table_ = jnp.asarray(visible & keep), table
    return (q, kv, ring, fb, pool, table_, selected, sink), fb


def _both(args, fb):
    kw = dict(scale=HD**-0.5, window=WINDOW)
    ref = sparse_attention_ref(*args, **kw)
    out = sparse_attention(*args, **kw, interpret=INTERPRET)
    valid = np.asarray(fb.valid)
    return np.asarray(out, np.float32)[valid], np.asarray(ref, np.float32)[valid]


@pytest.mark.parametrize("compressed", [True, False], ids=["compressed", "sliding"])
def test_fp32_matches_reference(compressed):
    out, ref = _both(*_inputs(jnp.float32, compressed))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


def test_bf16_matches_reference():
    out, ref = _both(*_inputs(jnp.bfloat16))
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_replay_from_empty_state_hides_the_ring():
    """history_start > 0: ring entries below it were never filled for this slot and must be masked."""
    out, ref = _both(*_inputs(jnp.float32, history_start=20))
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


def test_no_visible_key_gives_zero():
    """A token that sees nothing (every compressed row unselected, nothing in the ring, alone in its
    row) puts all the mass on the sink: the output is exactly 0, not NaN."""
    args, fb = _inputs(jnp.float32, rows=((0, 0, 1),), pad=0)
    q, kv, ring, fb, pool, table, selected, sink = args
    out = sparse_attention(q, kv, ring, fb, pool, table, jnp.zeros_like(selected), sink, scale=0.25, window=WINDOW,
                           interpret=INTERPRET)
    # the token sees only itself: the result is its own key weighted by p / (p + e^sink)
    lg = float(jnp.dot(q[0].astype(jnp.float32), kv[0]) [0]) * 0.25
    w = np.exp(lg - max(lg, float(sink[0])))
    expect = w / (w + np.exp(float(sink[0]) - max(lg, float(sink[0])))) * np.asarray(kv[0])
    np.testing.assert_allclose(np.asarray(out[0, 0]), expect, rtol=1e-5, atol=1e-6)


def test_catches_a_wrong_window():
    """The comparison has teeth: a kernel seeing one key too many per side disagrees with the reference."""
    args, fb = _inputs(jnp.float32)
    ref = sparse_attention_ref(*args, scale=HD**-0.5, window=WINDOW)
    wrong = sparse_attention(*args, scale=HD**-0.5, window=WINDOW + 1, interpret=INTERPRET)
    assert not np.allclose(np.asarray(wrong)[np.asarray(fb.valid)], np.asarray(ref)[np.asarray(fb.valid)], atol=1e-4)


def test_a_token_does_not_see_the_batch():
    """The kernel's result for a row is bitwise the same alone or among other rows (batch-invariant
    mode's contract), with the same slots and pages."""
    args, fb = _inputs(jnp.float32)
    full = np.asarray(sparse_attention(*args, scale=HD**-0.5, window=WINDOW, interpret=INTERPRET))
    alone_args, fb1 = _inputs(jnp.float32, rows=ROWS[2:3], pad=0)
    q, kv, ring, _, pool, table, selected, sink = args
    lo, n = 6, ROWS[2][2]  # row 2's tokens sit at flat 6..9 in the full batch
    table1 = table[lo : lo + n]
    alone = sparse_attention(q[lo : lo + n], kv[lo : lo + n], ring, fb1, pool, table1, selected[lo : lo + n], sink,
                             scale=HD**-0.5, window=WINDOW, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(alone), full[lo : lo + n])
