"""The engine on a mesh: its parallel layout (EngineConfig's vLLM-named sizes) turned into a
ShardingPlan carried by the model config, and the weights placed by it. One device: unchanged."""

from __future__ import annotations

import logging

import jax

from sharding.placement import place_params

log = logging.getLogger("deepinfer.runtime.mesh")


def on_mesh(family, cfg, params: dict, config, devices=None) -> tuple:
    """(cfg with ``sharding`` set, params placed on the mesh); as given on one device. ``devices``:
    those to build the mesh from (default: every device JAX sees)."""
    parallel = config.parallel()
    if parallel.is_single_device:
        return cfg, params
    plan = parallel.plan(devices if devices is not None else jax.devices())
    if plan.expert_axes and cfg.n_routed_experts % plan.expert_parallel_size:
        raise ValueError(f"enable_expert_parallel: {cfg.n_routed_experts} routed experts do not split evenly over "
                         f"{plan.expert_parallel_size} devices")
    cfg = cfg.replace(sharding=plan)
    params = place_params(params, family.param_specs(cfg), plan)
    log.info("parallel layout: %s (tensor %d, expert parallel %s)", plan.describe(), parallel.tensor_parallel_size,
             parallel.enable_expert_parallel)
    return cfg, params
