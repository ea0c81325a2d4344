"""The three routed-expert formulations (grouped ragged_dot, gathered, dense) agree.

On CPU the model picks gathered (decode) or dense; the ragged_dot path serves
accelerators, so it is checked here directly against the other two.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.models.deepseek_v4 import moe
from tests.reference import load_case


@pytest.mark.parametrize("n_tokens", [1, 3, 40])
def test_expert_formulations_agree(n_tokens):
    case = load_case("mixed")
    cfg, p = case.cfg, case.params["layers"][2]["ffn"]
    x = jnp.asarray(np.random.default_rng(n_tokens).normal(size=(n_tokens, cfg.hidden_size)), jnp.float32)
    weights, experts = moe.route(cfg, p["gate"], "moe", x, jnp.zeros(n_tokens, jnp.int32))
    outs = [
        np.asarray(jax.jit(f, static_argnums=0)(cfg, p["experts"], x, weights, experts))
        for f in (moe._grouped_experts, moe._gathered_experts, moe._dense_experts)
    ]
    scale = np.max(np.abs(outs[0]))
    assert scale > 0.1
    for other in outs[1:]:
        assert np.max(np.abs(other - outs[0])) <= 1e-5 * scale
