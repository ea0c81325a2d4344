"""Batch-invariant mode: the needle test (bitwise equal outputs alone vs inside random batches, with
its companion: the same harness finds differences with the mode off), and the tiling the mode rests on."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.models.deepseek_v4.ops import linear
from deepinfer.numerics import fixed_sum, token_tiled
from deepinfer.runtime.batch_invariance import CPU_FLAG, check_xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_needle(*args: str, **extra_env: str) -> dict:
    env = {**os.environ, "DEEPINFER_BATCH_INVARIANT": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the mode must set what it needs itself
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-m", "tests.needle_batch_invariance", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# The default suite: the bundled model and one drawn config, a small budget (many chunks) and the
# default one (steps of up to 256 tokens), two trials each (seeded: the same batches every run;
# 165 s, against 300 s for three). `pytest -m slow` runs the whole matrix (three drawn configs,
# budgets up to 2048, six trials).
DEFAULT = ("--models", "bundled,random:1", "--budgets", "13,256", "--trials", "2")
FULL = ("--models", "bundled,random:3", "--budgets", "13,32,256,2048", "--trials", "6")


@pytest.fixture(scope="module")
def needle():
    return run_needle(*DEFAULT)


def check_needle(result: dict, trials: int) -> None:
    for model, budgets in result["on"].items():
        for budget, r in budgets.items():
            assert (r["differing"], r["token_mismatch"]) == (0, 0), (model, budget, r)
            assert r["trials"] == trials
            if budget in ("256", "2048"):  # steps really filled the large bucket
                assert r["largest_step_tokens"] > int(budget) // 2, (model, r)
    # the companion: with the mode off the same harness finds differences at every budget
    for model, budgets in result.get("off", {}).items():
        for budget, r in budgets.items():
            assert r["differing"] >= 1, (model, budget, r)


def test_needle_is_bitwise_identical_in_batch_invariant_mode(needle):
    assert set(needle["on"]) == {"bundled", "random0"}
    check_needle(needle, trials=2)


def test_needle_with_the_kernels_is_bitwise_identical():
    """DEEPINFER_KERNELS=pallas in the mode (interpret mode here): the MoE grouped-matmul kernel runs
    (attention and the indexer stay on the references, tests/test_kernel_probe.py); the needle's
    tokens and logprobs are still bitwise those of its alone run (22 s: one budget, one trial)."""
    result = run_needle("--models", "bundled", "--budgets", "13", "--trials", "1", "--modes", "on",
                        DEEPINFER_KERNELS="pallas")
    assert set(result) == {"on"}
    check_needle(result, trials=1)


def test_needle_on_a_data_tensor_and_expert_parallel_mesh_is_bitwise_identical():
    """The mode on a DP2 x TP2 mesh with EP4 (4 fake CPU devices: attention data-parallel over 2 ranks
    of 2 tensor-parallel devices, the experts over all 4): the needle alone and inside random batches,
    on whichever rank it lands, bitwise. The mesh's collectives add each element's per-device parts in
    an order fixed by the mesh, not by the batch, and a rank's tokens pass the MoE exchange unchanged,
    so the invariance holds per layout; against one device it does not (a split contraction or the
    experts' partial sums add in another order; tests/test_parallel_engine.py compares layouts within
    the fp32 tolerance instead). With the mode off the same run differed in 2 of 2 trials (measured
    2026-12-05; TP2 + EP2 alone: 2 of 2 on 2026-12-04)."""
    layout = {"data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True}
    result = run_needle("--models", "bundled", "--budgets", "32", "--trials", "2", "--modes", "on",
                        "--layout", json.dumps(layout), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    check_needle(result, trials=2)


@pytest.mark.slow
def test_needle_full_matrix():
    check_needle(run_needle(*FULL), trials=6)


def test_token_tiled_gives_every_row_the_same_bits_at_any_token_count():
    """What the mode rests on: a per-token function run in fixed tiles gives a row the same
    bits whatever the count and wherever the row sits. Checked on products whose plain
    form is known to vary with the row count on some CPUs (an expert product, a
    matrix-vector at one row) and on a chain of elementwise ops and reductions."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 40, 64)).astype(np.float32))
    fns = {
        "experts": lambda x: jnp.einsum("nd,eid->nei", x, w),
        "linear": lambda x: linear(x, w[0]),
        "softmax-norm": lambda x: jax.nn.softmax(x * 3.0, axis=-1) / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-6),
    }
    v = rng.normal(size=(64,)).astype(np.float32)
    for name, fn in fns.items():
        f = jax.jit(lambda x, fn=fn: token_tiled(fn, x))
        bits = set()
        for count, at in [(1, 0), (2, 1), (7, 3), (16, 0), (17, 16), (61, 30), (256, 255), (2048, 1000)]:
            x = rng.normal(size=(count, 64)).astype(np.float32)
            x[at] = v
            bits.add(np.asarray(f(jnp.asarray(x)))[at].tobytes())
        assert len(bits) == 1, name


def test_token_tiled_is_the_function_over_pytrees_and_ragged_counts():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=(21, 3)).astype(np.float32))
    b = jnp.asarray(rng.integers(0, 5, size=(21,)).astype(np.int32))
    out = token_tiled(lambda t: {"sum": t["a"].sum(-1) * t["b"], "b": t["b"] + 1}, {"a": a, "b": b})
    np.testing.assert_allclose(np.asarray(out["sum"]), np.asarray(a).sum(-1) * np.asarray(b), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(b) + 1)
    one = token_tiled(lambda t: t * 2, a[:1])
    assert one.shape == (1, 3) and np.array_equal(np.asarray(one), np.asarray(a[:1]) * 2)


def test_fixed_sum_is_a_sum_and_row_independent():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(300, 4, 37)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(fixed_sum(x, -1)), np.asarray(x).sum(-1), rtol=1e-5, atol=1e-5)
    f = jax.jit(lambda a: fixed_sum(a, -1))
    assert len({np.asarray(f(x[:b]))[0].tobytes() for b in (1, 2, 16, 32, 300)}) == 1
    np.testing.assert_allclose(np.asarray(fixed_sum(x, 1, keepdims=True)), np.asarray(x).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


def _pairwise_tree_numpy(x: np.ndarray) -> np.ndarray:
    """fixed_sum's order written out in float32 numpy: zero-pad to a power of two, then add halves."""
    width = 1 << max(x.shape[-1] - 1, 0).bit_length()
    x = np.concatenate([x, np.zeros(x.shape[:-1] + (width - x.shape[-1],), np.float32)], axis=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def test_fixed_sum_fuses_in_bounded_groups_with_the_tree_order_unchanged(monkeypatch):
    # the barriers that keep XLA GPU's compile bounded (BENCHMARKS.md §6) sit every
    # FUSED_TREE_LEVELS levels and leave the adds alone: the bits are the written-out tree's,
    # and with a producer fused into the first levels (as in a softmax) the same as without barriers
    from deepinfer import numerics

    def softmax_denominator(a):
        return numerics.fixed_sum(jnp.exp(a / 100) * a, -1)

    rng = np.random.default_rng(2)
    for width in (5, 17, 333, 4096):
        x = jnp.asarray((rng.standard_normal((3, width)) * 100).astype(np.float32))
        exact = np.asarray(jax.jit(lambda a: numerics.fixed_sum(a, -1))(x))
        assert exact.tobytes() == _pairwise_tree_numpy(np.asarray(x)).tobytes(), width
        levels = max(width - 1, 0).bit_length()
        barriers = jax.jit(lambda a: numerics.fixed_sum(a, -1)).lower(x).as_text().count("optimization_barrier")
        assert barriers == (levels - 1) // numerics.FUSED_TREE_LEVELS, (width, barriers)
        fused = np.asarray(jax.jit(softmax_denominator)(x))
        with monkeypatch.context() as m:
            m.setattr(numerics, "FUSED_TREE_LEVELS", 1 << 20)  # no barrier at all: XLA fuses as it likes
            unbarred_fn = jax.jit(lambda a: softmax_denominator(a))  # a new function: traced again
            assert "optimization_barrier" not in unbarred_fn.lower(x).as_text()
            unbarred = np.asarray(unbarred_fn(x))
        assert fused.tobytes() == unbarred.tobytes(), width


def test_mode_refuses_a_cpu_backend_without_the_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(RuntimeError, match="needs XLA_FLAGS=" + CPU_FLAG):
        check_xla("cpu")
    check_xla("gpu")  # nothing to do elsewhere
