"""The engine on a mesh: its parallel layout (EngineConfig's vLLM-named sizes) turned into a
ShardingPlan carried by the model config, the expert weights put in physical slots when EPLB is
on, and the weights placed by the plan. One device without EPLB: unchanged."""

from __future__ import annotations

import dataclasses
import logging

import jax

from deepinfer.params import ParamSpec
from sharding import expert_placement
from sharding.placement import place_params

log = logging.getLogger("deepinfer.runtime.mesh")


def on_mesh(family, cfg, params: dict, config, devices=None) -> tuple:
    """(cfg with ``sharding`` set, params placed on the mesh, the expert placement [layers, slots] or
    None). ``devices``: those to build the mesh from (default: every device JAX sees)."""
    parallel = config.parallel()
    plan = None if parallel.is_single_device else parallel.plan(devices if devices is not None else jax.devices())
    placement = None
    if config.enable_eplb:
        slots = cfg.n_routed_experts + config.num_redundant_experts
        ep = plan.expert_parallel_size if plan is not None else 1
        if slots % ep:
            raise ValueError(f"EPLB: {cfg.n_routed_experts} experts + {config.num_redundant_experts} redundant = {slots} "
                             f"slots do not split evenly over {ep} expert-parallel devices")
        placement = expert_placement.round_robin(len(params["layers"]), cfg.n_routed_experts, slots)
        params = expert_placement.expand(params, placement)
    if plan is None:
        return cfg, params, placement
    if plan.expert_axes and cfg.n_routed_experts % plan.expert_parallel_size and placement is None:
        raise ValueError(f"enable_expert_parallel: {cfg.n_routed_experts} routed experts do not split evenly over "
                         f"{plan.expert_parallel_size} devices (EPLB's redundant slots can make them)")
    cfg = cfg.replace(sharding=plan)
    params = place_params(params, _with_placement_specs(family.param_specs(cfg), params), plan)
    log.info("parallel layout: %s (tensor %d, expert parallel %s)", plan.describe(), parallel.tensor_parallel_size,
             parallel.enable_expert_parallel)
    return cfg, params, placement


def _with_placement_specs(spec_tree: dict, params: dict) -> dict:
    """The spec tree plus EPLB's tables (small, whole on every device); the physical expert slots keep
    their logical axes ("experts" split over the expert axes)."""
    if "placement" not in params["layers"][0]["ffn"]:
        return spec_tree
    layers = []
    for spec, layer in zip(spec_tree["layers"], params["layers"]):
        tab = layer["ffn"]["placement"]
        specs = {k: ParamSpec(tuple(v.shape), (None,) * v.ndim, dtype="int32") for k, v in tab.items()}
        slots = layer["ffn"]["experts"]["w1"].shape[0]
        experts = {k: dataclasses.replace(v, shape=(slots, *v.shape[1:])) for k, v in spec["ffn"]["experts"].items()}
        layers.append({**spec, "ffn": {**spec["ffn"], "experts": experts, "placement": specs}})
    return {**spec_tree, "layers": layers}
