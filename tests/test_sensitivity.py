"""Every weight is used: perturbing any single tensor moves the logits beyond the tolerance."""

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.models.deepseek_v4 import forward
from deepinfer.params import flatten_dotted, unflatten_dotted
from tests.reference import load_case

TOLERANCE = 1e-4


def perturb(path: str, value: jax.Array, rng: np.random.Generator) -> jax.Array:
    arr = np.asarray(value)
    if path.endswith("tid2eid"):
        return jnp.asarray((arr + 1) % (arr.max() + 1))
    if path.endswith("gate.bias"):
        # The score-correction bias only selects experts: move it enough to change choices.
        return jnp.asarray(arr + rng.normal(0, 5.0, arr.shape).astype(arr.dtype))
    return jnp.asarray(arr + rng.normal(0, max(float(arr.std()), 0.3), arr.shape).astype(arr.dtype))


def test_perturbing_any_tensor_changes_the_logits():
    case = load_case("mixed")  # has sliding, CSA and HCA layers with enough rows, hash and score MoE
    fwd = jax.jit(forward, static_argnums=0)
    base = np.asarray(fwd(case.cfg, case.params, case.tokens))
    tol = TOLERANCE * np.max(np.abs(base))
    flat = flatten_dotted(case.params)
    rng = np.random.default_rng(0)
    unused = []
    for path, value in flat.items():
        changed = dict(flat)
        changed[path] = perturb(path, value, rng)
        out = np.asarray(fwd(case.cfg, unflatten_dotted(case.params, changed), case.tokens))
        if np.max(np.abs(out - base)) <= tol:
            unused.append(path)
    assert len(flat) > 100
    assert not unused, f"perturbing these tensors did not change the logits: {unused}"
