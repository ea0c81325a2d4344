"""``import deepinfer`` turns on XLA options before JAX starts (runtime/xla_defaults.py): the one that
lets XLA CPU update a donated per-slot state leaf in place although the same program reads it."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a ring read for this step's own slot and updated in place, donated: how every per-slot state leaf
# goes through the engine's step; prints how many full copies of it the compiled program makes
PROBE = """
import deepinfer, re, jax, jax.numpy as jnp
ring, slot, pos, vals = jnp.zeros((16, 76, 64)), jnp.array([3]), jnp.array([5]), jnp.ones((1, 64))
def step(r, s, p, v):
    own = jnp.take(r, s, axis=0, mode="clip")
    return own.sum(), r.at[s, p].set(v, mode="drop")
text = jax.jit(step, donate_argnums=0).lower(ring, slot, pos, vals).compile().as_text()
print("copies", len(re.findall(r"= f32\\[16,76,64\\]\\S* copy\\(", text[text.index("ENTRY"):])))
"""


def _copies(xla_flags: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split("copies")[-1])


@pytest.mark.skipif(__import__("jax").default_backend() != "cpu", reason="an XLA CPU option")
def test_state_read_and_updated_in_one_step_is_not_copied():
    assert _copies(None) == 0
    # the user's own value wins, and without the option XLA CPU copies the leaf (twice)
    assert _copies("--xla_cpu_copy_insertion_use_region_analysis=false") > 0


def test_defaults_leave_the_users_flags_alone(monkeypatch):
    from deepinfer.runtime.xla_defaults import add_default_flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    add_default_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2 --xla_cpu_copy_insertion_use_region_analysis=true"
    add_default_flags()  # idempotent
    assert os.environ["XLA_FLAGS"].count("region_analysis") == 1
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_copy_insertion_use_region_analysis=false")
    add_default_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_copy_insertion_use_region_analysis=false"
