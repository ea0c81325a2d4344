"""The three routed-expert formulations (grouped ragged_dot, pair loop, expert by expert) agree.

On CPU the model picks the pair loop (few (token, expert) pairs) or expert by expert; the
ragged_dot path serves accelerators, so it is checked here directly against the other two.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.models.deepseek_v4 import moe
from tests.reference import load_case


def _layer_inputs(n_tokens: int, seed: int):
    case = load_case("mixed")
    cfg, p = case.cfg, case.params["layers"][2]["ffn"]
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(n_tokens, cfg.hidden_size)), jnp.float32)
    weights, experts = moe.route(cfg, p["gate"], "moe", x, jnp.zeros(n_tokens, jnp.int32))
    return cfg, p["experts"], x, weights, experts


@pytest.mark.parametrize("n_tokens", [1, 3, 40])
def test_expert_formulations_agree(n_tokens):
    cfg, p, x, weights, experts = _layer_inputs(n_tokens, n_tokens)
    outs = [
        np.asarray(jax.jit(f, static_argnums=0)(cfg, p, x, weights, experts))
        for f in (moe._grouped_experts, moe._pair_loop_experts, moe._expert_by_expert)
    ]
    scale = np.max(np.abs(outs[0]))
    assert scale > 0.1
    for other in outs[1:]:
        assert np.max(np.abs(other - outs[0])) <= 1e-5 * scale


def test_pair_loop_result_does_not_depend_on_the_token_count():
    """A token's bits are the same alone and among 7 others (each program runs the same loop body),
    which keeps speculative verification steps and plain decode steps on the same numbers."""
    cfg, p, x, weights, experts = _layer_inputs(8, 0)
    run = jax.jit(moe._pair_loop_experts, static_argnums=0)
    together = np.asarray(run(cfg, p, x, weights, experts))
    for t in (0, 5):
        alone = np.asarray(run(cfg, p, x[t:t + 1], weights[t:t + 1], experts[t:t + 1]))
        np.testing.assert_array_equal(alone[0], together[t])


def test_expert_by_expert_skips_picks_of_zero_weight():
    """Expert parallelism hands a device's foreign picks with weight 0: they add nothing, and an
    expert only such picks name is not run at all. Shown with that expert's weights set to NaN:
    run, it would turn the sums NaN (NaN * 0 is NaN); skipped, the output is the real picks' alone."""
    cfg, p, x, weights, experts = _layer_inputs(3, 1)
    first = set(np.asarray(experts[:, 0]).tolist())
    unused = next(e for e in range(cfg.n_routed_experts) if e not in first)
    poisoned = {name: w.at[unused].set(jnp.nan) for name, w in p.items()}
    run = jax.jit(moe._expert_by_expert, static_argnums=0)
    out = np.asarray(run(cfg, poisoned, x, weights.at[:, 1].set(0.0), experts.at[:, 1].set(unused)))
    only_first = np.asarray(run(cfg, p, x, weights[:, :1], experts[:, :1]))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, only_first, rtol=0, atol=1e-6 * np.max(np.abs(only_first)))
