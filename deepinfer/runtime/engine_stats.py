"""What an engine holds now, for metrics and /debug: one read, no reaching into the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds now (for metrics and /debug): one read, no reaching into the scheduler."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of all KV pages held by requests
    pages_used: dict[str, int] = field(default_factory=dict)  # per pool
    slots_used: int = 0
    num_preemptions: int = 0  # since start
    # speculative decoding since start (vLLM's meanings: a draft is one verified row)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    # prefix caching since start: tokens looked up / skipped by hits; pages only the cache holds
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_replayed: int = 0
    pages_cached: dict[str, int] = field(default_factory=dict)
    pages_free: dict[str, int] = field(default_factory=dict)
    cached_blocks: int = 0
    snapshots: int = 0
    # model steps since start, and the decode bursts among their dispatches (several steps each)
    num_steps: int = 0
    num_decode_bursts: int = 0
    # step programs: token buckets ready to dispatch, and those a background warm-up still compiles
    programs_ready: tuple[int, ...] = ()
    programs_compiling: tuple[int, ...] = ()


def pages_cached(sched) -> dict[str, int]:
    """Per pool: pages only the prefix cache holds (evictable when a request needs room)."""
    if sched.cache is None:
        return {name: 0 for name in sched.pools}
    holds = sched.cache.page_refs()  # O(pages requests hold), not O(cached pages): read every step
    out = {}
    for name, on_blocks in holds.items():
        held = {p for r in sched.running for p in r.pages.get(name, ())}
        out[name] = len(on_blocks) - sum(1 for p in held if p in on_blocks)
    return out


def _ranks(sched) -> list:
    """The schedulers that hold pages: one, or each attention data-parallel rank's."""
    return getattr(sched, "ranks", [sched])


def _per_pool(sched) -> dict[str, dict[str, int]]:
    """Per pool, summed over ranks: pages, free pages, pages only the prefix cache holds."""
    out: dict[str, dict[str, int]] = {}
    for rank in _ranks(sched):
        cached = pages_cached(rank)
        for name, pool in rank.pools.items():
            figures = out.setdefault(name, {"pages": 0, "free": 0, "cached": 0})
            figures["pages"] += pool.num_pages
            figures["free"] += pool.num_free
            figures["cached"] += cached[name]
    return out


def _cache_total(sched, attr: str) -> int:
    return sum(getattr(r.cache, attr) for r in _ranks(sched) if r.cache is not None)


def kv_usage(sched) -> float:
    """Fraction of the KV pages (all pools together) held by requests, in [0, 1]; pages only the
    prefix cache holds count as free, as in vLLM."""
    pools = _per_pool(sched).values()
    total = sum(p["pages"] for p in pools)
    return sum(p["pages"] - p["free"] - p["cached"] for p in pools) / total if total else 0.0


def engine_stats(engine) -> EngineStats:
    sched = engine.scheduler
    pools = _per_pool(sched)
    spec = sched.spec_stats
    return EngineStats(
        running=len(sched.running),
        waiting=len(sched.waiting),
        kv_usage=kv_usage(sched),
        pages_used={name: p["pages"] - p["free"] - p["cached"] for name, p in pools.items()},
        slots_used=sched.slots.num_slots - sched.slots.num_free,
        num_preemptions=sched.num_preemptions,
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        accepted_per_position=tuple(spec.accepted_per_position[: engine.num_drafts]),
        prefix_queries=_cache_total(sched, "queries"),
        prefix_hits=_cache_total(sched, "hits"),
        prefix_replayed=_cache_total(sched, "replayed"),
        pages_cached={name: p["cached"] for name, p in pools.items()},
        pages_free={name: p["free"] for name, p in pools.items()},
        cached_blocks=_cache_total(sched, "num_blocks"),
        snapshots=_cache_total(sched, "num_snapshots_held"),
        num_steps=engine.num_steps,
        num_decode_bursts=engine.num_decode_bursts,
        programs_ready=engine.ready_token_buckets(),
        programs_compiling=engine.warming.compiling_tokens() if engine.warming is not None else (),
    )
