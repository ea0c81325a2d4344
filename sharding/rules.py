"""Logical axis names -> mesh axes: one rules table per parallel layout.

Every parameter declares logical axis names (deepinfer/params.py). A preset maps
some of them to mesh axes; the rest stay replicated. A new layout is a new
preset, never a model edit. A dimension whose size the mesh axis does not divide
is an error naming the parameter, so a layout never silently replicates.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer.params import ParamSpec, flatten_dotted, map_specs

Rules = Mapping[str, str | tuple[str, ...] | None]

PRESETS: dict[str, Rules] = {
    # One device, or every device holding everything.
    "replicated": {},
    # Expert parallelism: routed experts split over the "ep" mesh axis.
    "ep": {"experts": "ep"},
    # Tensor parallelism of the wide projections over "tp"; experts over "ep", each
    # expert's inner dimension ("expert_mlp") over "tp" as well on this 2-D mesh.
    "tp_ep": {
        "experts": "ep",
        "q_heads": "tp",
        "index_heads": "tp",
        "vocab": "tp",
        "mlp": "tp",
        "expert_mlp": "tp",
    },
}


def logical_to_partition_spec(axes: tuple[str | None, ...], rules: Rules) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def _check_divisible(path: str, spec: ParamSpec, pspec: PartitionSpec, mesh: Mesh) -> None:
    for dim, (size, mesh_axes) in enumerate(zip(spec.shape, pspec)):
        if mesh_axes is None:
            continue
        names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        parts = 1
        for name in names:
            if name not in mesh.shape:
                raise ValueError(f"{path}: rules use mesh axis {name!r}, but the mesh has {tuple(mesh.shape)}")
            parts *= mesh.shape[name]
        if size % parts:
            raise ValueError(
                f"{path}: dimension {dim} ({spec.axes[dim]}, size {size}) is not divisible by mesh axes {names} ({parts})"
            )


def param_shardings(spec_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """A NamedSharding per parameter, shaped like ``spec_tree``."""
    for path, spec in flatten_dotted(spec_tree).items():
        _check_divisible(path, spec, logical_to_partition_spec(spec.axes, rules), mesh)
    return map_specs(lambda s: NamedSharding(mesh, logical_to_partition_spec(s.axes, rules)), spec_tree)


def shard_params(params: Any, shardings: Any) -> Any:
    """Place an existing parameter tree according to ``shardings``."""
    return jax.tree.map(jax.device_put, params, shardings)
