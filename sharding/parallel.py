"""The parallel layout a user asks for, in vLLM's words, and the mesh + rules it becomes.

    ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True)

* ``tensor_parallel_size`` (mesh axis "tp"): the wide projections split by heads / vocabulary /
  MLP width (GSPMD inserts the reductions); V4's one KV head is not split, so the engine state is
  replicated over "tp".
* ``data_parallel_size`` ("dp"): attention data-parallel, each rank its own slots, page pools and
  requests (scheduler/data_parallel.py); the step runs per rank inside a shard_map over "dp"
  (runtime/data_parallel.py), and only the MoE layers exchange tokens between ranks.
* ``context_parallel_size`` ("cp"): a long prompt's chunk split over ranks (balanced order).
* ``enable_expert_parallel``: routed experts split over every device (vLLM: EP = DP x TP, here
  x CP too), tokens' expert work done where the expert lives (models/deepseek_v4/moe.py);
  without it the experts are split by their MLP width over "tp" like the dense MLPs.

The mesh is ("dp", "cp", "tp") over the first dp * cp * tp devices, "tp" innermost (the devices
that talk most are neighbours: on a GPU node, NVLink peers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharding.plan import ShardingPlan

MESH_AXES = ("dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    context_parallel_size: int = 1

    def __post_init__(self):
        for key in ("data_parallel_size", "tensor_parallel_size", "context_parallel_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {v!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size * self.tensor_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.world_size == 1

    def rules(self) -> dict:
        """Logical axis -> mesh axes (deepinfer/params.py declares the names, state.py the state's)."""
        rules: dict = {}
        if self.tensor_parallel_size > 1:
            rules.update({"q_heads": "tp", "heads": "tp", "index_heads": "tp", "o_lora": "tp", "vocab": "tp",
                          "mlp": "tp"})
            if not self.enable_expert_parallel:
                rules["expert_mlp"] = "tp"
        if self.enable_expert_parallel:
            rules["experts"] = self.expert_axes()
        if self.data_parallel_size > 1:  # each rank its own slots and pages (state leaves "slot" / "pages:<pool>")
            rules.update({"slot": "dp", "pages": "dp"})
        return rules

    def expert_axes(self) -> tuple[str, ...]:
        """The mesh axes the routed experts are split over (every axis: EP = DP x CP x TP)."""
        return MESH_AXES if self.enable_expert_parallel else ()

    def plan(self, devices) -> ShardingPlan:
        """The mesh over the first world_size of ``devices`` and this layout's rules."""
        from jax.sharding import Mesh

        if len(devices) < self.world_size:
            raise ValueError(f"the layout needs {self.world_size} devices (data {self.data_parallel_size} x context "
                             f"{self.context_parallel_size} x tensor {self.tensor_parallel_size}); "
                             f"{len(devices)} are visible")
        grid = np.array(devices[: self.world_size]).reshape(
            self.data_parallel_size, self.context_parallel_size, self.tensor_parallel_size)
        return ShardingPlan(Mesh(grid, MESH_AXES), tuple(sorted(self.rules().items())), self.expert_axes())

    @classmethod
    def from_dict(cls, d: dict | None) -> "ParallelConfig":
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"parallel layout: unknown keys {sorted(unknown)} (known: "
                             f"{', '.join(cls.__dataclass_fields__)})")
        return cls(**d)
