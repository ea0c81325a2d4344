"""What the scheduler does with the prefix cache (prefix_cache.py) around each step: a lookup
when a request is admitted, blocks and checkpoints after a step is planned, a snapshot when a
request leaves (finished or preempted). The device operations these imply travel on the
step plan (``StepPlan.cache``) and run before the step's program (runtime/prefix_ops.py).
Host only."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.scheduler.allocators import OutOfPages
from deepinfer.scheduler.prefix_cache import SNAPSHOT, Hit, PrefixCache
from deepinfer.scheduler.request import Request


@dataclass
class CacheOps:
    """Device operations to run before a step, in this order: saves (slot -> store entry: states
    left by earlier steps), restores (store entry -> slot), page copies, penalty statistics."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    clears: list[int] = field(default_factory=list)  # slots whose penalty counts start over
    copies: list[tuple[str, int, int]] = field(default_factory=list)  # (pool, src page, dst page)
    marks: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, token, 1: an output / 0: prompt)

    def __bool__(self) -> bool:
        return bool(self.saves or self.restores or self.clears or self.copies or self.marks)


def _known(req: Request) -> int:
    return len(req.prompt_token_ids) + req.num_resolved


def chunk_end(cache: PrefixCache | None, req: Request, n: int) -> int:
    """Tokens of req to compute this step: a prefill chunk stops at the next checkpoint inside the prompt."""
    if cache is None or cache.settings.mode != SNAPSHOT or n <= 1:
        return n
    interval = cache.settings.checkpoint_interval
    start = req.num_computed
    mark = (start // interval + 1) * interval
    return mark - start if mark < min(start + n, len(req.prompt_token_ids)) else n


def lookup(cache: PrefixCache | None, req: Request) -> Hit | None:
    """A waiting request's hit. Requests that want prompt logprobs compute every position (as in vLLM)."""
    if cache is None or req.sampling_params.prompt_logprobs is not None:
        return None
    known = _known(req)
    return cache.lookup(req.all_token_ids[:known], req.cache_salt, known - 1)


def peek(cache: PrefixCache, req: Request) -> int:
    """Tokens a waiting request's hit would skip here (0: none); attention data-parallel places a
    request on the rank where this is largest. (The lookup marks the blocks it walks as used.)"""
    hit = lookup(cache, req)
    return hit.restore_len if hit is not None else 0


def account(cache: PrefixCache | None, req: Request, hit: Hit | None) -> None:
    """An admitted request's lookup, for the hit-rate metrics (tokens queried, tokens hit)."""
    if cache is not None and req.sampling_params.prompt_logprobs is None:
        cache.record(_known(req) - 1, hit)


def admit(cache: PrefixCache, req: Request, hit: Hit) -> list | None:
    """Give req the hit's pages and progress. Returns the page copies, or None when the pools
    cannot hold the copies (req is left as it was)."""
    try:
        pages, copies = cache.admit(hit)
    except OutOfPages:
        return None
    req.pages, req.cache_nodes = pages, list(hit.path)
    req.num_computed, req.shared_until, req.history_start = hit.restore_len, hit.tokens, hit.history_start
    return copies


def undo(cache: PrefixCache, req: Request, hit: Hit) -> None:
    """Admission failed after ``admit`` (no room to grow): hand everything back."""
    for name, pages in req.pages.items():
        cache.pools[name].free(pages)
    cache.release(req.cache_nodes)
    cache.pinned.discard(hit.snapshot)
    req.pages, req.num_computed, req.shared_until, req.history_start = {}, 0, 0, 0


def plan_restore(ops: CacheOps, req: Request, hit: Hit, copies: list) -> None:
    """The device side of an admitted hit (req has its slot now)."""
    if hit.snapshot is not None:
        ops.restores.append((req.slot, hit.snapshot))
    ops.clears.append(req.slot)
    ops.copies.extend(copies)
    if req.sampling_params.uses_penalties:  # the skipped tokens still count: prompt membership, output counts after a preemption
        plen = len(req.prompt_token_ids)
        ops.marks.extend((req.slot, t, int(i >= plen)) for i, t in enumerate(req.all_token_ids[: hit.restore_len]))
    req.num_cached_tokens = hit.restore_len


def after_schedule(cache: PrefixCache, plan, queued: list) -> None:
    """Register what this step computes (visible to lookups of later steps, which run after it)
    and checkpoint chunks that end at a checkpoint; their saves run before the next step."""
    interval = cache.settings.checkpoint_interval
    for req, n in plan.scheduled:
        start, plen = plan.starts[req.request_id], len(req.prompt_token_ids)
        end = start + n
        upto = min(req.num_computed, _known(req))
        at_checkpoint = req.request_id not in plan.drafts and (end == plen or (end % interval == 0 and end < plen))
        if at_checkpoint and end <= upto:
            entry = cache.checkpoint(req.cache_nodes, req.all_token_ids, end, req.pages, req.cache_salt)
            if entry is not None:
                queued.append((req.slot, entry))
        # only when a block completes (most decode steps complete none; all_token_ids copies the whole context)
        if (len(req.cache_nodes) + 1) * cache.settings.block_size <= upto:
            cache.register(req.cache_nodes, req.all_token_ids, upto, req.pages, req.cache_salt)


def on_leave(cache: PrefixCache, req: Request, queued: list) -> None:
    """A request finishing or being preempted: cache its tokens and a snapshot of its slot where it
    stopped (the state of every step dispatched so far, within max_backtrack of that point)."""
    end = min(req.num_computed, _known(req))
    if req.slot is None or end <= 0:
        return
    cache.register(req.cache_nodes, req.all_token_ids, end, req.pages, req.cache_salt)
    entry = cache.checkpoint(req.cache_nodes, req.all_token_ids, end, req.pages, req.cache_salt)
    if entry is not None:
        queued.append((req.slot, entry))
