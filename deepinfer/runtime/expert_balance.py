"""The expert-parallel load balancer's engine side: the loads the device counted, a new placement
computed from them by the policy (sharding/eplb.py), applied to the weights between steps.

    figures = rebalance(engine)          # or EngineConfig(eplb_step_interval=N): every N steps

The step programs are not compiled again: a placement is new values of arrays of the same shapes
and shardings (sharding/expert_placement.py).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from deepinfer.runtime.prefix_ops import leaf_kinds
from sharding import eplb, expert_placement

log = logging.getLogger("deepinfer.runtime.eplb")


def _counter(engine) -> int:
    kinds = leaf_kinds(engine.family, engine.cfg, engine.layout)
    if "count" not in kinds:
        raise ValueError("expert loads are counted only with enable_eplb")
    return kinds.index("count")


def expert_loads(engine) -> np.ndarray:
    """[layers, experts] tokens routed to each expert since the last rebalance (waits for the device)."""
    return np.asarray(jax.tree.leaves(engine.state.model)[_counter(engine)])


def _reset(engine) -> None:
    leaves, treedef = jax.tree.flatten(engine.state.model)
    i = _counter(engine)
    leaves[i] = leaves[i] * 0  # same shape and sharding: the programs stay as they are
    engine.state = engine.state.replace(model=jax.tree.unflatten(treedef, leaves))


def rebalance(engine, policy: str = "global") -> dict:
    """Compute a placement from the counted loads, apply it, reset the counts. Returns the max / mean
    tokens per device over layers before and after (on the loads just counted)."""
    loads = expert_loads(engine)
    plan = engine.cfg.sharding
    devices = plan.expert_parallel_size if plan is not None else 1
    current = engine.expert_placement
    new = eplb.rebalance_experts(loads, current.shape[1], devices, policy=policy).phy2log
    figures = {"before": eplb.imbalance(loads, current, devices), "after": eplb.imbalance(loads, new, devices)}
    engine.params = expert_placement.apply(engine.params, current, new)
    engine.expert_placement = new
    _reset(engine)
    log.info("EPLB (%s): max / mean tokens per device %.3f -> %.3f", policy, figures["before"], figures["after"])
    return figures
