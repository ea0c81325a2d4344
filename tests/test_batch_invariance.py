"""Batch-invariant mode: the needle test (bitwise equal outputs alone vs inside random batches),
its companion (the same harness finds differences with the mode off), and the jaxlib kernel
assumptions the mode rests on."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.models.deepseek_v4.ops import fixed_sum, linear
from deepinfer.runtime.batch_invariance import CPU_FLAG, check_xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def needle():
    env = {**os.environ, "DEEPINFER_BATCH_INVARIANT": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the mode must set what it needs itself
    out = subprocess.run([sys.executable, "-m", "tests.needle_batch_invariance", "--trials", "24"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_needle_is_bitwise_identical_in_batch_invariant_mode(needle):
    assert needle["on"] == {"trials": 24, "differing": 0, "token_mismatch": 0}


def test_needle_harness_detects_differences_with_the_mode_off(needle):
    assert needle["off"]["differing"] >= 6, needle  # so the test above is able to fail


def test_two_dimensional_matmuls_do_not_depend_on_the_row_count():
    """The mode assumes this of the installed jaxlib: x[b, in] @ w[out, in].T gives row 0 the same
    bits for every b >= 2. If an upgrade breaks it, this fails loudly (then tile the token axis)."""
    rng = np.random.default_rng(0)
    for d_in, d_out in [(32, 96), (512, 1536), (1024, 1024), (512, 4096)]:
        w = jnp.asarray(rng.normal(size=(d_out, d_in)).astype(np.float32))
        x = jnp.asarray(rng.normal(size=(256, d_in)).astype(np.float32))
        f = jax.jit(linear)
        rows = {np.asarray(f(x[:b], w))[0].tobytes() for b in (2, 3, 8, 17, 32, 61, 64, 128, 256)}
        assert len(rows) == 1, (d_in, d_out)


def test_fixed_sum_is_a_sum_and_row_independent():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(300, 4, 37)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(fixed_sum(x, -1)), np.asarray(x).sum(-1), rtol=1e-5, atol=1e-5)
    f = jax.jit(lambda a: fixed_sum(a, -1))
    assert len({np.asarray(f(x[:b]))[0].tobytes() for b in (1, 2, 16, 32, 300)}) == 1
    np.testing.assert_allclose(np.asarray(fixed_sum(x, 1, keepdims=True)), np.asarray(x).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_mode_refuses_a_cpu_backend_without_the_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(RuntimeError, match="needs XLA_FLAGS=" + CPU_FLAG):
        check_xla("cpu")
    check_xla("gpu")  # nothing to do elsewhere
