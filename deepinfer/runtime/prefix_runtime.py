"""The engine's side of prefix caching: the cache's settings from the engine's, the snapshot
store on the device, and the dispatch of a plan's cache operations before its step."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from deepinfer.runtime.ahead_of_time import CompileAhead, abstract
from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.runtime.data_parallel import rank_layout
from deepinfer.runtime.prefix_ops import (
    MARKS_PER_DISPATCH,
    OpsShape,
    cache_ops_jit,
    init_store,
    marks_bucket,
    pack_ops,
    snapshot_bytes,
)
from deepinfer.runtime.prefix_ops_dp import dp_cache_ops_jit, pack_ranks
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
    """The snapshot store and the cache-operations program of one engine. With data parallelism each
    rank's operations run on its own devices with its local ids (runtime/prefix_ops_dp.py), the store
    split by rank."""

    def __init__(self, engine, settings: CacheSettings):
        self.engine = engine
        self.settings = settings
        self.entries = max(settings.num_snapshots, 1)  # a rank's; one unused entry keeps the shapes simple
        self.num_snapshots = self.entries * engine.ranks  # the store's: rank r's entries from r * entries
        self.store = init_store(engine.family, engine.cfg, engine.layout, engine.dtype, self.num_snapshots)
        self.bytes_per_snapshot = snapshot_bytes(engine.family, engine.cfg, engine.layout, engine.dtype)
        self.num_ops = 2 * engine.config.max_num_seqs
        self._local = rank_layout(engine.layout, engine.ranks)  # the slots and pages a rank's ids name
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

    def take(self, plan) -> None:
        """Dispatch the plan's operations (each rank's own, with data parallelism) and clear them."""
        ranks = plan.parts if self.engine.ranks > 1 else [plan]
        ops = [part.cache for part in ranks]
        for part in {id(p): p for p in ranks + [plan]}.values():
            part.cache = CacheOps()
        self.apply(ops)

    def apply(self, ops_per_rank: list[CacheOps]) -> None:
        """Dispatch the operations (asynchronous; ordered before whatever is dispatched next): the
        saves, restores, clears and copies in chunks of num_ops, then the penalty marks (which follow
        the restores) in chunks of MARKS_PER_DISPATCH: two program shapes in all. One CacheOps per
        rank (local ids)."""
        k = self.num_ops
        marks = [ops.marks for ops in ops_per_rank]
        rest = [CacheOps(ops.saves, ops.restores, ops.clears, ops.copies, []) for ops in ops_per_rank]
        while any(rest):
            self._dispatch([CacheOps(o.saves[:k], o.restores[:k], o.clears[:k], o.copies[:k], []) for o in rest])
            rest = [CacheOps(o.saves[k:], o.restores[k:], o.clears[k:], o.copies[k:], []) for o in rest]
        for i in range(0, max(map(len, marks)), MARKS_PER_DISPATCH):
            self._dispatch([CacheOps(marks=m[i : i + MARKS_PER_DISPATCH]) for m in marks])

    def _program_and_ints(self, ops_per_rank: list[CacheOps], shape: OpsShape):
        local = self._local
        if self.engine.ranks == 1:
            return cache_ops_jit, pack_ops(ops_per_rank[0], shape, local.num_slots, local.num_pages)
        return dp_cache_ops_jit, pack_ranks(ops_per_rank, shape, local.num_slots, local.num_pages)

    def _dispatch(self, ops_per_rank: list[CacheOps], shape: OpsShape | None = None) -> None:
        e = self.engine
        shape = shape or self._ops_shape(ops_per_rank)
        program, ints = self._program_and_ints(ops_per_rank, shape)
        with CompileCounter() as counter:
            e.state, self.store = program(e.family, e.cfg, e.layout, shape, e.state, self.store, jax.device_put(ints))
        e.num_compiles += counter.count

    def _ops_shape(self, ops_per_rank: list[CacheOps]) -> OpsShape:
        return OpsShape(self.num_ops, marks_bucket(max(len(ops.marks) for ops in ops_per_rank)), self.entries)

    def shapes(self) -> list[OpsShape]:
        """The program's two shapes: without penalty marks, and with a chunk of them."""
        return [OpsShape(self.num_ops, m, self.entries) for m in (0, MARKS_PER_DISPATCH)]

    def _empty(self) -> list[CacheOps]:
        return [CacheOps() for _ in range(self.engine.ranks)]

    def _abstract_args(self, shape: OpsShape) -> tuple:
        e = self.engine
        program, ints = self._program_and_ints(self._empty(), shape)
        return program, (e.family, e.cfg, e.layout, shape, abstract(e.state), abstract(self.store),
                         abstract(jnp.asarray(ints)))

    def lower(self, shape: OpsShape):
        """The operations program for ``shape``, lowered (``.compile().as_text()``: its HLO)."""
        program, args = self._abstract_args(shape)
        return program.lower(*args)

    def compile_ahead(self) -> CompileAhead:
        """Start compiling warmup()'s programs on a worker thread (the engine's thread meanwhile
        compiles its first step program); ``join()`` it before warmup()."""
        calls = [self._abstract_args(shape) for shape in self.shapes()]
        return CompileAhead(calls[0][0], [args for _, args in calls])

    def warmup(self) -> None:
        """Compile the programs (no marks, a chunk of marks) with operations that all fall out of range."""
        for shape in self.shapes():
            self._dispatch(self._empty(), shape)
