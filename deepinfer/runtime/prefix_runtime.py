"""The engine's side of prefix caching: the cache's settings from the engine's, the snapshot
store on the device, and the dispatch of a plan's cache operations before its step."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from deepinfer.runtime.ahead_of_time import CompileAhead, abstract
from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.runtime.prefix_ops import (
    MARKS_PER_DISPATCH,
    OpsShape,
    cache_ops_jit,
    init_store,
    marks_bucket,
    pack_ops,
    snapshot_bytes,
)
from deepinfer.scheduler.prefix_cache import RECOMPUTE, SNAPSHOT, CacheSettings
from deepinfer.scheduler.prefix_steps import CacheOps

log = logging.getLogger("deepinfer.runtime.engine")


def cache_settings(family, cfg, config, layout) -> CacheSettings | None:
    """None when prefix caching is off. A family without per-slot state (horizon 0) needs no snapshots."""
    if not config.enable_prefix_caching:
        return None
    horizon_fn = getattr(family, "replay_horizon", None)
    horizon = horizon_fn(cfg, layout) if horizon_fn is not None else None
    mode = RECOMPUTE if horizon == 0 else config.prefix_replay
    if mode == RECOMPUTE and horizon is None:
        raise ValueError(f"prefix_replay='recompute' needs a bounded replay horizon; {type(family).__name__} has none")
    block = config.prefix_block_size
    if block is None:  # a block must lie inside one page of every pool
        spans = [p.tokens_per_row * config.page_size for p in family.pools(cfg)]
        block = math.gcd(16, *spans) if spans else 16
    interval = -(-config.prefix_checkpoint_interval // block) * block
    return CacheSettings(
        block_size=block,
        checkpoint_interval=interval,
        num_snapshots=config.num_prefix_snapshots() if mode == SNAPSHOT else 0,
        mode=mode,
        horizon=horizon,
        max_backtrack=config.max_backtrack,
        drafting=layout.draft,
    )


class PrefixRuntime:
    """The snapshot store and the cache-operations program of one engine."""

    def __init__(self, engine, settings: CacheSettings):
        self.engine = engine
        self.settings = settings
        # one unused entry keeps the shapes simple; data parallelism: every rank's entries (rank r's from r * E)
        self.num_snapshots = max(settings.num_snapshots, 1) * engine.ranks
        self.store = init_store(engine.family, engine.cfg, engine.layout, engine.dtype, self.num_snapshots)
        self.bytes_per_snapshot = snapshot_bytes(engine.family, engine.cfg, engine.layout, engine.dtype)
        self.num_ops = 2 * engine.config.max_num_seqs
        log.info("prefix cache: blocks of %d tokens, replay %s%s; %d snapshots of %.1f KiB (%.1f MiB)",
                 settings.block_size, settings.mode,
                 f" (checkpoints every {settings.checkpoint_interval} tokens)" if settings.mode == SNAPSHOT
                 else f" ({settings.horizon} tokens from an empty slot state)",
                 settings.num_snapshots, self.bytes_per_snapshot / 1024,
                 settings.num_snapshots * self.bytes_per_snapshot / 2**20)

    def reset(self) -> None:
        """After the engine state was rebuilt (the store may have been donated to a failed call)."""
        e = self.engine
        self.store = init_store(e.family, e.cfg, e.layout, e.dtype, self.num_snapshots)

    def apply(self, ops: CacheOps) -> None:
        """Dispatch the operations (asynchronous; ordered before whatever is dispatched next): the
        saves, restores, clears and copies in chunks of num_ops, then the penalty marks (which follow
        the restores) in chunks of MARKS_PER_DISPATCH: two program shapes in all."""
        k, marks = self.num_ops, ops.marks
        ops = CacheOps(ops.saves, ops.restores, ops.clears, ops.copies, [])
        while ops:
            self._dispatch(CacheOps(ops.saves[:k], ops.restores[:k], ops.clears[:k], ops.copies[:k], []))
            ops = CacheOps(ops.saves[k:], ops.restores[k:], ops.clears[k:], ops.copies[k:], [])
        for i in range(0, len(marks), MARKS_PER_DISPATCH):
            self._dispatch(CacheOps(marks=marks[i : i + MARKS_PER_DISPATCH]))

    def _dispatch(self, ops: CacheOps, shape: OpsShape | None = None) -> None:
        e = self.engine
        shape = shape or self._ops_shape(ops)
        ints = pack_ops(ops, shape, e.layout.num_slots, e.layout.num_pages)
        with CompileCounter() as counter:
            e.state, self.store = cache_ops_jit(e.family, e.cfg, e.layout, shape, e.state, self.store,
                                                jax.device_put(ints))
        e.num_compiles += counter.count

    def _ops_shape(self, ops: CacheOps) -> OpsShape:
        return OpsShape(self.num_ops, marks_bucket(len(ops.marks)), self.num_snapshots)

    def _shapes(self) -> list[OpsShape]:
        """The program's two shapes: without penalty marks, and with a chunk of them."""
        return [OpsShape(self.num_ops, m, self.num_snapshots) for m in (0, MARKS_PER_DISPATCH)]

    def compile_ahead(self) -> CompileAhead:
        """Start compiling warmup()'s programs on a worker thread (the engine's thread meanwhile
        compiles its first step program); ``join()`` it before warmup()."""
        e = self.engine
        state, store = abstract(e.state), abstract(self.store)

        def empty(shape):  # the packed operations of an empty CacheOps, as an abstract array
            return abstract(jnp.asarray(pack_ops(CacheOps(), shape, e.layout.num_slots, e.layout.num_pages)))

        return CompileAhead(cache_ops_jit, [(e.family, e.cfg, e.layout, shape, state, store, empty(shape))
                                            for shape in self._shapes()])

    def warmup(self) -> None:
        """Compile the programs (no marks, a chunk of marks) with operations that all fall out of range."""
        for shape in self._shapes():
            self._dispatch(CacheOps(), shape)
