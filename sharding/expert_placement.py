"""Expert placement on the device (EPLB): routed experts stored in physical slots, some experts
replicated, and a placement changed between steps without recompiling.

A MoE layer with a placement keeps its expert weights as ``[P, ...]`` physical slots (P = experts +
redundant ones; with expert parallelism slot s lives on device s // (P / ep)) and two small tables
in its parameters, ``ffn.placement``: ``log2phy [E, R]`` (the slots holding each logical expert,
padded with its first) and ``replicas [E]``. They are jit arguments like the weights, so a new
placement is new values of the same shapes: the step programs are reused. The router still picks
logical experts; models/deepseek_v4/moe.py maps each pick to one of its replicas.

The policy choosing a placement from measured loads is sharding/eplb.py (host side, numpy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def tables(phy2log: np.ndarray, num_experts: int) -> dict[str, np.ndarray]:
    """phy2log [L, P] -> {"log2phy": [L, E, P - E + 1], "replicas": [L, E]} (int32). Every logical
    expert must hold at least one slot."""
    phy2log = np.asarray(phy2log)
    num_layers, num_slots = phy2log.shape
    width = num_slots - num_experts + 1  # the most replicas an expert can have: a fixed shape
    log2phy = np.zeros((num_layers, num_experts, width), np.int32)
    replicas = np.zeros((num_layers, num_experts), np.int32)
    for layer in range(num_layers):
        for slot, expert in enumerate(phy2log[layer]):
            if not 0 <= expert < num_experts:
                raise ValueError(f"placement: layer {layer} slot {slot} holds expert {expert}, outside 0..{num_experts - 1}")
            log2phy[layer, expert, replicas[layer, expert]] = slot
            replicas[layer, expert] += 1
        missing = np.flatnonzero(replicas[layer] == 0)
        if missing.size:
            raise ValueError(f"placement: layer {layer} has no slot for experts {missing.tolist()}")
        for expert in range(num_experts):  # padding repeats the first replica (never chosen)
            log2phy[layer, expert, replicas[layer, expert]:] = log2phy[layer, expert, 0]
    return {"log2phy": log2phy, "replicas": replicas}


def round_robin(num_layers: int, num_experts: int, num_slots: int) -> np.ndarray:
    """The placement before any load is known: expert e in slot e, the redundant slots replicating
    experts 0, 1, ... in turn."""
    return np.tile(np.arange(num_slots) % num_experts, (num_layers, 1)).astype(np.int32)


def physical_choice(placement: dict, experts: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Logical experts [N, k] -> physical slots [N, k]. A replicated expert's tokens spread over its
    replicas by token id (not by position in the step: a token's slot, and so the device order its
    partial sums are added in, must not depend on its neighbours; batch-invariant mode relies on it)."""
    k = experts.shape[-1]
    spread = token_ids.astype(jnp.int32)[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None, :]
    replica = spread % placement["replicas"][experts]
    return jnp.take_along_axis(placement["log2phy"][experts], replica[..., None], axis=-1)[..., 0]


def moe_layers(params: dict) -> list[int]:
    return [i for i, layer in enumerate(params["layers"]) if "experts" in layer["ffn"]]


def expand(params: dict, phy2log: np.ndarray) -> dict:
    """Logical expert weights [E, ...] -> physical slots [P, ...] by ``phy2log`` [L, P], with the
    placement tables; the other parameters are shared, not copied."""
    num_experts = params["layers"][0]["ffn"]["experts"]["w1"].shape[0]
    tab = tables(phy2log, num_experts)
    layers = []
    for i, layer in enumerate(params["layers"]):
        ffn = dict(layer["ffn"])
        slots = jnp.asarray(phy2log[i])
        ffn["experts"] = jax.tree.map(lambda w, s=slots: w[s], ffn["experts"])
        ffn["placement"] = {"log2phy": jnp.asarray(tab["log2phy"][i]), "replicas": jnp.asarray(tab["replicas"][i])}
        layers.append({**layer, "ffn": ffn})
    return {**params, "layers": layers}


def _move(leaves, source, shardings):
    """Each leaf's slots gathered from ``source``, left where the leaf was (the step programs were
    compiled for that placement of the arrays: another would compile them again)."""
    return [w[source] if s is None else jax.lax.with_sharding_constraint(w[source], s) for w, s in zip(leaves, shardings)]


# not donated: a step still in flight may read the current weights (briefly twice the experts' memory)
_move_jit = jax.jit(_move, static_argnums=(2,))


def _placed(a):
    """An array's sharding on a mesh; None for one device's (left uncommitted, as the engine's own are:
    a committed copy would be another program signature, compiled again)."""
    return a.sharding if len(a.sharding.device_set) > 1 else None


def _putter(like):
    sharding = _placed(like)
    return jnp.asarray if sharding is None else (lambda x: jax.device_put(x, sharding))


def apply(params: dict, current: np.ndarray, new: np.ndarray) -> dict:
    """Params holding placement ``current`` [L, P] rearranged to ``new`` (same shape): each new slot
    copies a current slot holding its expert, on the device, keeping every array's sharding."""
    num_experts = params["layers"][0]["ffn"]["placement"]["replicas"].shape[0]
    cur = tables(current, num_experts)
    tab = tables(new, num_experts)
    layers = []
    for i, layer in enumerate(params["layers"]):
        ffn = dict(layer["ffn"])
        source = cur["log2phy"][i, new[i], 0]  # a current slot of each new slot's expert
        put = _putter(ffn["placement"]["replicas"])
        leaves, treedef = jax.tree.flatten(ffn["experts"])
        moved = _move_jit(leaves, put(source.astype(np.int32)), tuple(_placed(w) for w in leaves))
        ffn["experts"] = jax.tree.unflatten(treedef, moved)
        ffn["placement"] = {"log2phy": put(tab["log2phy"][i]), "replicas": put(tab["replicas"][i])}
        layers.append({**layer, "ffn": ffn})
    return {**params, "layers": layers}
