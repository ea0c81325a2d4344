"""Save an idle engine's prefix cache with orbax and load it into a freshly started one.

What a cache is: its blocks (host, scheduler/prefix_persist.py), the pages of the KV pools those
blocks name, and the snapshot store's entries. All of it is saved, the pools and the store whole
(one orbax tree, ``arrays/``), the blocks beside them as JSON (``prefix_cache.json``, written
last: a save that died half-way is never loaded). A restarted server then answers its first
requests on a warm cache (``--prefix-cache-dir``).

A cache is only valid for the weights and the layout it was computed with, so the file carries
a fingerprint of both, and loading refuses, naming what differs, when the engine differs: another
model or other weights (config plus a strided sample of every parameter), another page size,
pool or store shape, block size, replay mode, drafter or number of data-parallel ranks.

Under attention data-parallel every rank has a prefix cache of its own over its share of the pools
and of the snapshot store, naming its rank-local page and entry ids (scheduler/data_parallel.py):
the file keeps one block list per rank (``ranks``), and as the arrays are saved and restored whole
over the same ranks, each rank's ids name the same rows again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from deepinfer.runtime.prefix_ops import leaf_kinds
from deepinfer.scheduler.prefix_persist import export_blocks, import_blocks

FORMAT, VERSION = "deepinfer-prefix-cache", 1
HOST_FILE, ARRAYS = "prefix_cache.json", "arrays"
_SAMPLES = 256  # values read from each parameter for the weights' fingerprint


def weights_fingerprint(cfg, params) -> str:
    """blake2b over the config and, per parameter leaf, its shape, dtype and a strided sample of its
    values: changing any parameter's shape or most changes of values give another fingerprint,
    without reading a 150 GB model back from the device."""
    h = hashlib.blake2b(json.dumps(cfg.to_hf_dict(), sort_keys=True, default=str).encode(), digest_size=16)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)}{leaf.dtype}".encode())
        flat = leaf.reshape(-1)
        step = max(1, flat.shape[0] // _SAMPLES)
        h.update(np.asarray(flat[::step][:_SAMPLES]).tobytes())
    return h.hexdigest()


def _layout(engine) -> dict[str, Any]:
    s = engine.prefix.settings
    pools, store = _arrays(engine)
    return {
        "page_size": engine.config.page_size,
        "block_size": s.block_size,
        "checkpoint_interval": s.checkpoint_interval,
        "mode": s.mode,
        "num_snapshots": s.num_snapshots,
        "drafting": s.drafting,
        "data_parallel_size": engine.ranks,
        "pools": [[list(x.shape), str(x.dtype)] for x in pools],
        "store": [[list(x.shape), str(x.dtype)] for x in store],
    }


def _arrays(engine) -> tuple[list[jax.Array], list[jax.Array]]:
    """The pool leaves of the engine's state (pages of compressed rows) and the snapshot store."""
    leaves = jax.tree.leaves(engine.state.model)
    kinds = leaf_kinds(engine.family, engine.cfg, engine.layout)
    return [x for x, k in zip(leaves, kinds) if k not in ("slot", "count")], list(engine.prefix.store)


def _caches(engine) -> list:
    """The host prefix caches: one, or one per data-parallel rank."""
    sched = engine.scheduler
    return [rank.cache for rank in sched.ranks] if engine.ranks > 1 else [sched.cache]


def _require(engine) -> None:
    if engine.prefix is None:
        raise ValueError("prefix caching is off in this engine")
    if engine.has_unfinished:
        raise RuntimeError("the prefix cache can only be saved or loaded while the engine is idle")


def save_prefix_cache(engine, directory: str | os.PathLike) -> dict[str, int]:
    """Write the idle engine's prefix cache to ``directory`` (replaced if it exists). Returns its size."""
    import orbax.checkpoint as ocp

    _require(engine)
    engine.step()  # an idle step dispatches the snapshots queued by requests that just finished
    ranks = [export_blocks(cache) for cache in _caches(engine)]
    pools, store = _arrays(engine)
    directory = os.fspath(directory)
    tmp = directory + ".saving"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        checkpointer.save(os.path.abspath(os.path.join(tmp, ARRAYS)), args=ocp.args.PyTreeSave({"pools": pools, "store": store}))
    finally:
        checkpointer.close()
    host = {"format": FORMAT, "version": VERSION, "weights": weights_fingerprint(engine.cfg, engine.params),
            "layout": _layout(engine)}
    host.update({"ranks": ranks} if len(ranks) > 1 else {"blocks": ranks[0]})
    with open(os.path.join(tmp, HOST_FILE), "w", encoding="utf-8") as f:
        json.dump(host, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return _summary(ranks)


def _summary(ranks: list[list[dict]]) -> dict[str, int]:
    blocks = [b for rank in ranks for b in rank]
    return {"blocks": len(blocks), "tokens": sum(len(b["tokens"]) for b in blocks),
            "snapshots": sum(b["snapshot"] is not None for b in blocks)}


def load_prefix_cache(engine, directory: str | os.PathLike) -> dict[str, int]:
    """Load a saved prefix cache into an idle engine whose cache is empty. Raises ValueError naming
    the difference when the cache was saved by an engine with other weights or another layout."""
    import orbax.checkpoint as ocp

    _require(engine)
    directory = os.fspath(directory)
    path = os.path.join(directory, HOST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            host = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: no readable saved prefix cache ({e})") from None
    if host.get("format") != FORMAT or host.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} file of version {VERSION}")
    if host["weights"] != weights_fingerprint(engine.cfg, engine.params):
        raise ValueError(f"{path} was saved with other model weights; its cached rows would be wrong here")
    now = _layout(engine)
    saved = {"data_parallel_size": 1, **host["layout"]}  # (files from before data parallelism have one rank)
    for key, value in now.items():
        if saved.get(key) != value:
            raise ValueError(f"{path} does not fit this engine: {key} was {saved.get(key)}, is {value}")
    pools, store = _arrays(engine)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), {"pools": pools, "store": store})
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        restored = checkpointer.restore(
            os.path.abspath(os.path.join(directory, ARRAYS)),
            args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
        )
    except Exception as e:  # orbax raises many types for a damaged folder
        raise ValueError(f"{directory}: the saved prefix cache's arrays cannot be read ({type(e).__name__})") from e
    finally:
        checkpointer.close()
    ranks = host["ranks"] if "ranks" in host else [host["blocks"]]
    for cache, blocks in zip(_caches(engine), ranks):
        import_blocks(cache, blocks)
    leaves, treedef = jax.tree.flatten(engine.state.model)
    kinds = leaf_kinds(engine.family, engine.cfg, engine.layout)
    it = iter(restored["pools"])
    leaves = [next(it) if k not in ("slot", "count") else x for x, k in zip(leaves, kinds)]
    engine.state = engine.state.replace(model=jax.tree.unflatten(treedef, leaves))
    engine.prefix.store = list(restored["store"])
    return _summary(ranks)
