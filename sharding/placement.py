"""Put a loaded parameter tree on a ShardingPlan's mesh, leaf by leaf.

The tree may be a subset of the spec tree (the MTP block skipped) and may hold QuantizedArrays
(FP8 / FP4 weights kept in their stored format): their data and scales are shaped differently
(packed bytes, per-block scales), so only a split of the leading axis, which the two share
(stacked experts), carries over to them; anything else of theirs stays whole on every device.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer.params import flatten_dotted, unflatten_dotted
from deepinfer.quant.formats import QuantizedArray


def _quantized_sharding(leaf: QuantizedArray, sharding: NamedSharding) -> NamedSharding:
    lead = sharding.spec[0] if len(sharding.spec) and leaf.ndim >= 3 else None
    return NamedSharding(sharding.mesh, PartitionSpec(lead))


def param_shardings_for(params: Any, spec_tree: Any, plan) -> dict[str, Any]:
    """{dotted path: sharding} for the leaves ``params`` has (a QuantizedArray: one for its parts)."""
    specs = flatten_dotted(spec_tree)
    shardings = flatten_dotted(plan.param_shardings(spec_tree))
    out = {}
    for path, leaf in flatten_dotted(params).items():
        if path not in specs:
            raise ValueError(f"{path}: a parameter the model's tree does not declare")
        out[path] = _quantized_sharding(leaf, shardings[path]) if isinstance(leaf, QuantizedArray) else shardings[path]
    return out


def place_params(params: Any, spec_tree: Any, plan) -> Any:
    """The same tree with every leaf on the plan's mesh (a leaf already placed so is not copied)."""
    shardings = param_shardings_for(params, spec_tree, plan)
    flat = flatten_dotted(params)
    placed = {path: jax.tree.map(lambda a, s=shardings[path]: _put(a, s), leaf) for path, leaf in flat.items()}
    return unflatten_dotted(params, placed)


def _put(a, sharding: NamedSharding):
    """One array onto its sharding. With several processes (jax.distributed) a mesh spans devices this
    process cannot address: each process builds its own devices' slices from its copy of the weights
    (every process loads the same checkpoint)."""
    if sharding.is_fully_addressable:
        return jax.device_put(a, sharding)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
