"""Put a loaded parameter tree on a ShardingPlan's mesh, leaf by leaf.

The tree may be a subset of the spec tree (the MTP block skipped) and may hold QuantizedArrays
(FP8 / FP4 weights kept in their stored format): their data and scales have the weight's rank and
axis meaning, so each part takes the weight's split where its own size divides (a part too small to
split, e.g. an FP8 scale's few block rows, stays whole on every device) — the loader places parts by
the same rule (deepinfer/weight_placement.part_sharding), so a tree loaded onto the mesh is not moved.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from deepinfer.params import flatten_dotted, unflatten_dotted
from deepinfer.quant.formats import QuantizedArray
from deepinfer.weight_placement import part_sharding


def param_shardings_for(params: Any, spec_tree: Any, plan) -> dict[str, Any]:
    """{dotted path: the weight's sharding} for the leaves ``params`` has."""
    specs = flatten_dotted(spec_tree)
    shardings = flatten_dotted(plan.param_shardings(spec_tree))
    out = {}
    for path in flatten_dotted(params):
        if path not in specs:
            raise ValueError(f"{path}: a parameter the model's tree does not declare")
        out[path] = shardings[path]
    return out


def place_params(params: Any, spec_tree: Any, plan) -> Any:
    """The same tree with every leaf on the plan's mesh (a leaf already placed so is not copied)."""
    shardings = param_shardings_for(params, spec_tree, plan)
    placed = {}
    for path, leaf in flatten_dotted(params).items():
        s = shardings[path]
        if isinstance(leaf, QuantizedArray):
            placed[path] = QuantizedArray(_put(leaf.data, part_sharding(s, leaf.data.shape)),
                                          _put(leaf.scale, part_sharding(s, leaf.scale.shape)),
                                          leaf.kind, leaf.block, leaf.dtype)
        else:
            placed[path] = _put(leaf, s)
    return unflatten_dotted(params, placed)


def _put(a, sharding: NamedSharding):
    """One array onto its sharding. With several processes (jax.distributed) a mesh spans devices this
    process cannot address: each process builds its own devices' slices from its copy of the weights
    (every process loads the same checkpoint)."""
    if sharding.is_fully_addressable:
        return jax.device_put(a, sharding)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
