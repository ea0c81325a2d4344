"""The engine on a mesh: its parallel layout (EngineConfig's vLLM-named sizes) turned into a
ShardingPlan carried by the model config, the expert weights put in physical slots when EPLB is
on, and the weights placed by the plan (one device without EPLB: as they are), then laid out as the
platform's dots want them (on a CPU, models/deepseek_v4/weight_layout.py)."""

from __future__ import annotations

import dataclasses
import logging

import jax

from deepinfer.params import ParamSpec
from deepinfer.runtime.platform import platform_in_use
from sharding import expert_placement
from sharding.placement import place_params

log = logging.getLogger("deepinfer.runtime.mesh")


def on_mesh(family, cfg, params: dict, config, devices=None) -> tuple:
    """(cfg with ``sharding`` set, params placed on the mesh (one device: as they are) and then in the
    platform's compute layout (the family's ``compute_layout``, e.g. a CPU's transposed projections),
    the expert placement [layers, slots] or None). ``devices``: those to build the mesh from (default:
    every device JAX sees)."""
    lay = getattr(family, "compute_layout", None)
    if lay is None:
        return _placed(family, cfg, params, config, devices)
    moves = config.enable_eplb or not config.parallel().is_single_device
    # (another engine's params may come laid out already: placement reads the loaded layout)
    cfg, params, placement = _placed(family, cfg, family.checkpoint_layout(params) if moves else params, config,
                                     devices)
    return cfg, lay(params, platform_in_use()), placement


def _placed(family, cfg, params: dict, config, devices) -> tuple:
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


def load_shardings(config, devices=None):
    """For the loader: a function cfg -> {tree path: NamedSharding}, so that each weight goes straight
    to its devices as it is read (V4-Flash's weights do not fit on one device first). None on one
    device and with several processes (a mesh spanning other processes' devices is placed after
    loading, each process building its own slices: sharding/placement.py). The mesh is the one
    on_mesh builds from the same devices, and a quantized weight's parts are split by the same rule
    (weight_placement.part_sharding) there and in the loader, so on_mesh finds every weight placed."""
    parallel = config.parallel()
    if parallel.is_single_device or jax.process_count() > 1:
        return None

    def shardings_for(cfg) -> dict:
        from deepinfer.models.registry import family_for
        from deepinfer.params import flatten_dotted

        plan = parallel.plan(devices if devices is not None else jax.devices())
        if plan.expert_axes and cfg.n_routed_experts % plan.expert_parallel_size:
            return None  # the experts split evenly only once EPLB puts them in their slots (on_mesh)
        return flatten_dotted(plan.param_shardings(family_for(cfg).param_specs(cfg)))

    return shardings_for


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
