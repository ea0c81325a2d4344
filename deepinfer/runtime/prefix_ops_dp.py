"""Prefix-cache operations under attention data-parallel: each rank's operations run on its own
devices, with its local ids, inside one shard_map over "dp" (as the step does, runtime/data_parallel.py).

Rank r holds slots r * S .., the same share of every page pool, and entries r * E .. of the snapshot
store (prefix_ops.store_shardings): a rank's snapshots, restores and page copies never name another
rank's rows, so nothing crosses ranks. Before, the operations ran as one program on global ids over a
replicated store: every device held every rank's snapshots, and each dispatch all-reduced the saved
rows (1.2 MiB per dispatch on the bundled model, whatever the number of operations).
"""

from __future__ import annotations

import jax
import numpy as np

from deepinfer.runtime.data_parallel import num_ranks, per_rank
from deepinfer.runtime.prefix_ops import OpsShape, apply_ops, pack_ops, pin_store


def pack_ranks(ops_per_rank: list, shape: OpsShape, num_slots: int, pools) -> np.ndarray:
    """[ranks, L]: each rank's operations packed with its local ids (``num_slots`` and ``pools``: one rank's)."""
    return np.stack([pack_ops(ops, shape, num_slots, pools) for ops in ops_per_rank])


def dp_cache_ops(family, cfg, layout, shape: OpsShape, state, store: list[jax.Array], ints: jax.Array):
    """prefix_ops.cache_ops per rank: ``shape.num_snapshots`` is a rank's entries, ``ints`` [ranks, L]."""
    ranks = num_ranks(cfg)
    by_rank = [x.reshape(ranks, x.shape[0] // ranks, *x.shape[1:]) for x in store]

    def fn(local, params, state, store, ints):
        state, store = apply_ops(family, cfg, local, shape, state, store, ints)
        return store, state

    store, state = per_rank(fn, family, cfg, layout, (), (), state, (by_rank, ints))
    store = [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x in store]
    return state, pin_store(family, cfg, layout, store)


dp_cache_ops_jit = jax.jit(dp_cache_ops, static_argnums=(0, 1, 2, 3), donate_argnums=(4, 5))
