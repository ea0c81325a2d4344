"""The expert-parallel load balancer's policy: where each expert (and each replica of a hot one)
lives, from measured loads. Host side, numpy only; runtime/expert_balance.py applies the result.

The policy is DeepSeek's published EPLB (github.com/deepseek-ai/EPLB), re-derived here:

* replicate: P physical slots for E experts; each expert gets one, and every extra slot goes to the
  expert whose load per replica is then highest (its tokens are split evenly over its replicas);
* pack: items onto devices, the same number on each, heaviest first onto the lightest device that
  still has room (balanced packing: what bounds the slowest device's tokens per step);
* "global" (decode): replicate over all slots, pack onto all devices;
* "hierarchical" (prefill, several nodes): expert groups packed onto nodes first (group-limited routing
  keeps a token's experts within few nodes, so the all-to-all stays mostly inside a node), then
  replicate and pack within each node.

A placement is ``phy2log [layers, P]``: the logical expert of every physical slot; slot s lives on
device s // (P / devices).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

POLICIES = ("global", "hierarchical")


@dataclass(frozen=True)
class Placement:
    phy2log: np.ndarray  # [L, P] int32
    replica_count: np.ndarray  # [L, E] int32


def pack(weights: np.ndarray, num_packs: int) -> np.ndarray:
    """Items [n] -> the pack of each (n / num_packs items per pack), heaviest first onto the lightest
    pack with room; ties go to the lower pack index (deterministic)."""
    n = len(weights)
    per = n // num_packs
    load, room = np.zeros(num_packs), np.full(num_packs, per)
    out = np.empty(n, np.int64)
    for item in np.argsort(-np.asarray(weights, np.float64), kind="stable"):
        candidates = np.flatnonzero(room > 0)
        target = candidates[np.argmin(load[candidates])]
        out[item] = target
        load[target] += weights[item]
        room[target] -= 1
    return out


def replicate(loads: np.ndarray, num_slots: int) -> np.ndarray:
    """Loads [E] -> replicas per expert [E] summing to num_slots; extra slots to the highest load per replica."""
    count = np.ones(len(loads), np.int64)
    for _ in range(num_slots - len(loads)):
        count[np.argmax(loads / count)] += 1
    return count


def _place(loads: np.ndarray, experts: np.ndarray, num_slots: int, num_devices: int) -> np.ndarray:
    """One layer's slots for ``experts`` (their loads given) on num_devices devices: phy2log [num_slots]
    in device order, each device's slots by expert id."""
    count = replicate(loads, num_slots)
    items = np.repeat(np.arange(len(experts)), count)  # one item per replica
    device = pack(loads[items] / count[items], num_devices)
    order = np.lexsort((experts[items], device))
    return experts[items][order]


def _check(loads: np.ndarray, num_slots: int, num_devices: int, num_groups: int, num_nodes: int, policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"EPLB policy must be one of {POLICIES}, got {policy!r}")
    if loads.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {loads.shape}")
    if (loads < 0).any():
        raise ValueError("loads must be >= 0")
    experts = loads.shape[1]
    if num_slots < experts:
        raise ValueError(f"num_slots ({num_slots}) must be at least the number of experts ({experts})")
    if num_devices < 1 or num_slots % num_devices:
        raise ValueError(f"num_slots ({num_slots}) must split evenly over num_devices ({num_devices})")
    if policy == "hierarchical":
        if experts % num_groups or num_groups % num_nodes or num_devices % num_nodes:
            raise ValueError(f"hierarchical: experts ({experts}) must split into num_groups ({num_groups}), and groups "
                             f"and devices ({num_devices}) over num_nodes ({num_nodes})")


def rebalance_experts(loads, num_slots: int, num_devices: int, policy: str = "global", num_groups: int = 1,
                      num_nodes: int = 1) -> Placement:
    """A placement of every layer from its loads [L, E]."""
    loads = np.asarray(loads, np.float64)
    _check(loads, num_slots, num_devices, num_groups, num_nodes, policy)
    num_layers, num_experts = loads.shape
    phy2log = np.empty((num_layers, num_slots), np.int32)
    for layer in range(num_layers):
        w = loads[layer]
        if policy == "global":
            phy2log[layer] = _place(w, np.arange(num_experts), num_slots, num_devices)
            continue
        group_size = num_experts // num_groups
        node_of_group = pack(w.reshape(num_groups, group_size).sum(1), num_nodes)
        per_node = num_slots // num_nodes
        for node in range(num_nodes):
            experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                      for g in np.flatnonzero(node_of_group == node)])
            phy2log[layer, node * per_node:(node + 1) * per_node] = _place(
                w[experts], experts, per_node, num_devices // num_nodes)
    counts = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log]).astype(np.int32)
    return Placement(phy2log, counts)


def device_loads(loads, phy2log: np.ndarray, num_devices: int) -> np.ndarray:
    """[L, devices] tokens each device serves, an expert's load split evenly over its replicas."""
    loads = np.asarray(loads, np.float64)
    replicas = np.stack([np.bincount(row, minlength=loads.shape[1]) for row in phy2log])
    per_slot = np.take_along_axis(loads / replicas, phy2log, axis=1)
    return per_slot.reshape(loads.shape[0], num_devices, -1).sum(-1)


def imbalance(loads, phy2log: np.ndarray, num_devices: int) -> float:
    """Mean over layers of max / mean tokens per device (1.0: perfectly even)."""
    per = device_loads(loads, phy2log, num_devices)
    return float(np.mean(per.max(1) / np.maximum(per.mean(1), 1e-12)))


def identity(num_layers: int, num_experts: int) -> np.ndarray:
    """No balancing: expert e in slot e (the "before" of a comparison)."""
    return np.tile(np.arange(num_experts, dtype=np.int32), (num_layers, 1))
