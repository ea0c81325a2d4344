"""Mesh construction and logical-axis -> mesh-axis rules (see rules.py)."""

from sharding.rules import PRESETS, logical_to_partition_spec, param_shardings

__all__ = ["PRESETS", "logical_to_partition_spec", "param_shardings"]
