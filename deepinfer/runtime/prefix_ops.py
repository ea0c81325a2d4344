"""Device side of prefix caching: the snapshot store and the program that runs a step's cache
operations (scheduler/prefix_steps.CacheOps) before the step.

The store holds, per entry, a copy of every per-slot leaf of the family's state (the leaves
whose logical axes start with "slot": for V4 the window rings, the compressor rings and the
MTP ring), so it knows nothing about the family. The program, in order: saves (slot ->
entry), restores (entry -> slot), the copies of partially shared pages (page -> page, in
every leaf of the page's pool), then the penalty statistics of restored slots (cleared, and
the skipped tokens marked when the request has penalties). It only moves data, so it is
exact and batch-invariant. Shapes are fixed (``OpsShape``): one program, plus one per bucket
of penalty marks.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.kv.paged_state import EngineState, pin_state, state_shardings
from deepinfer.models.interface import ModelFamily, PagedLayout


@dataclass(frozen=True)
class OpsShape:
    num_ops: int  # K: saves, restores, clears and copies per pool, each padded to K
    num_marks: int  # M: penalty marks (0 or MARKS_PER_DISPATCH)
    num_snapshots: int


def leaf_kinds(family: ModelFamily, cfg, layout: PagedLayout) -> list[str]:
    """Per leaf of the family's state (flattened order): "slot", "count" (a device-side counter) or the pool name."""
    axes = jax.tree.leaves(family.state_axes(cfg, layout), is_leaf=lambda a: isinstance(a, tuple))
    return [a[0] if a[0] in ("slot", "count") else a[0].split(":", 1)[1] for a in axes]


def init_store(family: ModelFamily, cfg, layout: PagedLayout, dtype, num_snapshots: int) -> list[jax.Array]:
    """The zeroed snapshot store, built by one program (as kv/paged_state.init_engine_state: leaf by
    leaf, each new shape of zeros compiled a program of its own)."""
    return _init_store_jit(family, cfg, layout, jnp.dtype(dtype), num_snapshots)


def _init_store(family: ModelFamily, cfg, layout: PagedLayout, dtype, num_snapshots: int) -> list[jax.Array]:
    shapes = jax.tree.leaves(jax.eval_shape(lambda: family.init_state(cfg, layout, dtype)))
    kinds = leaf_kinds(family, cfg, layout)
    return pin_store(family, cfg, layout, [jnp.zeros((num_snapshots, *x.shape[1:]), x.dtype)
                                           for x, k in zip(shapes, kinds) if k == "slot"])


def store_shardings(family: ModelFamily, cfg, layout: PagedLayout) -> list | None:
    """On a mesh, each store leaf is placed as the per-slot state leaf it copies: its entries follow
    the rule for "slot", so under data parallelism rank r's devices hold rank r's entries (r * E ..)
    and a snapshot never leaves its rank; otherwise whole on every device. None: one device."""
    shardings = state_shardings(family, cfg, layout)
    if shardings is None:
        return None
    kinds = leaf_kinds(family, cfg, layout)
    return [s for s, k in zip(jax.tree.leaves(shardings.model), kinds) if k == "slot"]


def pin_store(family: ModelFamily, cfg, layout: PagedLayout, store: list[jax.Array]) -> list[jax.Array]:
    """Inside a program: the store placed the same way in and out of every program (as pin_state)."""
    shardings = store_shardings(family, cfg, layout)
    return store if shardings is None else jax.lax.with_sharding_constraint(store, shardings)


_init_store_jit = jax.jit(_init_store, static_argnums=(0, 1, 2, 3, 4))


def snapshot_bytes(family: ModelFamily, cfg, layout: PagedLayout, dtype) -> int:
    """Bytes of one snapshot: one slot's share of every per-slot leaf."""
    shapes = jax.tree.leaves(jax.eval_shape(lambda: family.init_state(cfg, layout, dtype)))
    kinds = leaf_kinds(family, cfg, layout)
    return sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize for x, k in zip(shapes, kinds) if k == "slot")


# Penalty marks per dispatch of the cache program: a hit's marks (one per restored token) go in
# chunks of this many, so the program has two shapes (none, a chunk) that warm-up compiles, instead
# of one per power of two that compiled mid-serving on the first long hit with penalties.
MARKS_PER_DISPATCH = 256


def marks_bucket(n: int) -> int:
    if n > MARKS_PER_DISPATCH:
        raise ValueError(f"{n} penalty marks in one dispatch: at most {MARKS_PER_DISPATCH} (PrefixRuntime.apply splits them)")
    return 0 if n == 0 else MARKS_PER_DISPATCH


def pack_ops(ops, shape: OpsShape, num_slots: int, pools: tuple[tuple[str, int], ...]) -> np.ndarray:
    """CacheOps -> one int32 buffer: save slot/entry, restore slot/entry, clears [K each], per pool
    copy src/dst [K each], mark slot/token/is-output [M each]. Padding points out of range (dropped)."""
    k, m = shape.num_ops, shape.num_marks
    saves = list({entry: slot for slot, entry in ops.saves}.items())  # a re-used entry: the last save wins

    def col(pairs, i, n, pad):
        out = np.full(n, pad, np.int32)
        vals = [p[i] for p in pairs]
        out[: len(vals)] = vals
        return out

    parts = [col(saves, 1, k, num_slots), col(saves, 0, k, shape.num_snapshots),
             col(ops.restores, 0, k, num_slots), col(ops.restores, 1, k, 0),
             col([(s,) for s in ops.clears], 0, k, num_slots)]
    for name, num_pages in pools:
        copies = [(src, dst) for pool, src, dst in ops.copies if pool == name]
        parts += [col(copies, 0, k, 0), col(copies, 1, k, num_pages)]
    parts += [col(ops.marks, 0, m, num_slots), col(ops.marks, 1, m, 0), col(ops.marks, 2, m, 0)]
    return np.concatenate(parts)


def cache_ops(family: ModelFamily, cfg, layout: PagedLayout, shape: OpsShape, state: EngineState,
              store: list[jax.Array], ints: jax.Array) -> tuple[EngineState, list[jax.Array]]:
    state, store = apply_ops(family, cfg, layout, shape, state, store, ints)
    return pin_state(family, cfg, layout, state), pin_store(family, cfg, layout, store)


def apply_ops(family: ModelFamily, cfg, layout: PagedLayout, shape: OpsShape, state: EngineState,
              store: list[jax.Array], ints: jax.Array) -> tuple[EngineState, list[jax.Array]]:
    """The operations of ``ints`` (pack_ops) on the state and store of ``layout``'s slots, pages and
    ``shape.num_snapshots`` entries (with data parallelism: one rank's, its local ids)."""
    k, m = shape.num_ops, shape.num_marks
    pools = [name for name, _ in layout.num_pages]
    cut = lambda i, n: ints[i : i + n]  # noqa: E731
    save_slot, save_id, restore_slot, restore_id, clear = (cut(i * k, k) for i in range(5))
    at = 5 * k
    copies = {}
    for name in pools:
        copies[name] = (cut(at, k), cut(at + k, k))
        at += 2 * k
    mark_slot, mark_tok, mark_out = cut(at, m), cut(at + m, m), cut(at + 2 * m, m)

    leaves, treedef = jax.tree.flatten(state.model)
    kinds = leaf_kinds(family, cfg, layout)
    slot_leaves = [x for x, kind in zip(leaves, kinds) if kind == "slot"]
    store = [s.at[save_id].set(jnp.take(x, save_slot, axis=0, mode="clip"), mode="drop")
             for s, x in zip(store, slot_leaves)]
    out, i = [], 0
    for x, kind in zip(leaves, kinds):
        if kind == "slot":
            x = x.at[restore_slot].set(jnp.take(store[i], restore_id, axis=0, mode="clip"), mode="drop")
            i += 1
        elif kind != "count":
            src, dst = copies[kind]
            x = x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"), mode="drop")
        out.append(x)
    counts = state.counts.at[clear].set(0, mode="drop")
    in_prompt = state.in_prompt.at[clear].set(False, mode="drop")
    if m:
        counts = counts.at[jnp.where(mark_out > 0, mark_slot, counts.shape[0]), mark_tok].add(1, mode="drop")
        in_prompt = in_prompt.at[jnp.where(mark_out > 0, in_prompt.shape[0], mark_slot), mark_tok].set(True, mode="drop")
    model = jax.tree.unflatten(treedef, out)
    return state.replace(model=model, counts=counts, in_prompt=in_prompt), store


cache_ops_jit = jax.jit(cache_ops, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
