"""ShardingPlan: a mesh and the rules that place every parameter and state leaf on it.

It travels inside the model config (``ModelConfig.sharding``, a static jit argument: a Mesh is
hashable), so the few places where the model itself must know the layout (expert-parallel MoE:
a shard_map over the expert axes) read it there, and everything else is placed by the rules
and left to XLA's partitioner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import logical_to_partition_spec, param_shardings


@dataclass(frozen=True)
class ShardingPlan:
    mesh: Mesh
    rules_items: tuple  # sorted (logical axis, mesh axes) pairs: a dict is not hashable
    expert_axes: tuple[str, ...] = ()  # mesh axes the routed experts are split over (() : not split)

    @property
    def rules(self) -> dict:
        return dict(self.rules_items)

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.shape.get("dp", 1)

    @property
    def expert_parallel_size(self) -> int:
        size = 1
        for a in self.expert_axes:
            size *= self.mesh.shape[a]
        return size

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.context_mesh(), PartitionSpec())

    def context_mesh(self):
        """The mesh to name a sharding against here: inside the data-parallel step's shard_map, the
        traced context's (its "dp" axis manual), else the plan's own."""
        return jax.sharding.get_abstract_mesh() if self.in_data_parallel_step() else self.mesh

    def param_shardings(self, spec_tree: Any) -> Any:
        """A NamedSharding per parameter (an indivisible dimension is an error naming it)."""
        return param_shardings(spec_tree, self.mesh, self.rules)

    def state_shardings(self, axes_tree: Any) -> Any:
        """A NamedSharding per state leaf from its logical axes ("slot", "pages:<pool>", ...)."""
        rules = self.rules

        def one(axes):  # "pages:<pool>" follows the rule for "pages" (every pool split alike)
            axes = tuple(a.split(":", 1)[0] if isinstance(a, str) and a.startswith("pages:") else a for a in axes)
            return NamedSharding(self.mesh, logical_to_partition_spec(axes, rules))

        return jax.tree.map(one, axes_tree, is_leaf=lambda x: isinstance(x, tuple))

    @property
    def context_parallel_size(self) -> int:
        return self.mesh.shape.get("cp", 1)

    def split_tokens(self, x: jax.Array, axis: int) -> jax.Array:
        """Context parallelism: ``x``'s token axis split over "cp" (each device computes its share of a
        step's tokens; what needs the others', attention's in-step keys and the state's writes, is
        gathered by the partitioner). Without "cp": ``x``."""
        if self.context_parallel_size == 1 or x.shape[axis] % self.context_parallel_size:
            return x  # (a step of fewer tokens than ranks, e.g. a small decode bucket: not split)
        spec = PartitionSpec(*(None,) * axis, "cp")
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.context_mesh(), spec))

    def in_data_parallel_step(self) -> bool:
        """Whether the code being traced runs per data-parallel rank: inside the engine step's
        shard_map over "dp" (runtime/data_parallel.py), where each rank holds its own tokens."""
        if self.data_parallel_size == 1:
            return False
        context = jax.sharding.get_abstract_mesh()
        return "dp" in getattr(context, "manual_axes", ())

    def describe(self) -> str:
        shape = " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        ep = f"; experts over {'x'.join(self.expert_axes)} ({self.expert_parallel_size})" if self.expert_axes else ""
        return f"mesh {shape} on {self.mesh.devices.flat[0].platform}{ep}"
