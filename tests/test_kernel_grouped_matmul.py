"""The MoE grouped-matmul kernels (SwiGLU fused) against their ragged_dot references, in interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (
    grouped_matmul,
    grouped_matmul_ref,
    grouped_swiglu,
    grouped_swiglu_ref,
)
from tests.kernel_batches import INTERPRET

E, D, I = 6, 512, 256  # D spans two 256-wide input chunks, I two 128-column tiles
LIMIT = 1.5  # low enough that the clamp bites on these random inputs

# group sizes over 6 experts: empty experts (first, middle, last), a tile (16 rows) straddled by several
# experts, one expert spanning tiles, a lone row, and rows past every group (padding: must come out 0)
GROUPS = {
    "straddle": ([0, 3, 0, 20, 1, 0], 30),
    "one_row": ([0, 0, 1, 0, 0, 0], 1),
    "all_empty": ([0, 0, 0, 0, 0, 0], 5),
    "one_expert": ([0, 0, 0, 0, 0, 37], 37),
}


def _inputs(dtype, sizes, n, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    rows = jax.random.normal(k[0], (n, D), jnp.float32).astype(dtype)
    w1 = (jax.random.normal(k[1], (E, I, D), jnp.float32) / 3).astype(dtype)
    w3 = (jax.random.normal(k[2], (E, I, D), jnp.float32) / 3).astype(dtype)
    w2 = (jax.random.normal(k[3], (E, D, I), jnp.float32) / 10).astype(dtype)
    return rows, w1, w3, w2, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(GROUPS))
def test_matches_reference(dtype, name):
    sizes, n = GROUPS[name]
    rows, w1, w3, w2, gs = _inputs(dtype, sizes, n)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    hidden = grouped_swiglu(rows, w1, w3, gs, limit=LIMIT, interpret=INTERPRET)
    ref_hidden = grouped_swiglu_ref(rows, w1, w3, gs, limit=LIMIT)
    assert hidden.dtype == ref_hidden.dtype == dtype and hidden.shape == (n, I)
    np.testing.assert_allclose(np.asarray(hidden, np.float32), np.asarray(ref_hidden, np.float32), **tol)
    out = grouped_matmul(ref_hidden, w2, gs, interpret=INTERPRET)
    ref_out = grouped_matmul_ref(ref_hidden, w2, gs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), **tol)
    # rows past every group belong to no expert
    covered = sum(sizes)
    assert not np.asarray(out[covered:]).any() and not np.asarray(hidden[covered:]).any()


def test_each_row_uses_its_own_expert():
    """Against a per-row loop in numpy: row r of expert e is swiglu(x_r @ w1[e].T, x_r @ w3[e].T)."""
    sizes, n = GROUPS["straddle"]
    rows, w1, w3, _, gs = _inputs(jnp.float32, sizes, n, seed=3)
    hidden = np.asarray(grouped_swiglu(rows, w1, w3, gs, limit=LIMIT, interpret=INTERPRET))
    owner = np.repeat(np.arange(E), sizes)
    x, a, b = (np.asarray(v, np.float64) for v in (rows, w1, w3))
    for r, e in enumerate(owner):
        gate, up = np.minimum(a[e] @ x[r], LIMIT), np.clip(b[e] @ x[r], -LIMIT, LIMIT)
        np.testing.assert_allclose(hidden[r], gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(w1[1]) @ np.asarray(rows[0]) - np.asarray(w1[3]) @ np.asarray(rows[0])).max() > 0.1


def test_rows_do_not_depend_on_their_neighbours():
    """Batch-invariant contract: a row's result is bitwise the same whatever other rows share its tile."""
    rows, w1, w3, _, _ = _inputs(jnp.float32, [0] * E, 30, seed=5)
    alone = grouped_swiglu(rows[3:4], w1, w3, jnp.asarray([0, 0, 0, 1, 0, 0], jnp.int32), limit=LIMIT,
                           interpret=INTERPRET)
    crowded = grouped_swiglu(rows, w1, w3, jnp.asarray([3, 0, 0, 20, 7, 0], jnp.int32), limit=LIMIT,
                             interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(crowded[3]))
