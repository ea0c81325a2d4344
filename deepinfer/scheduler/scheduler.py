"""The host scheduler: which requests run this step, and how many tokens each.

Policy (continuous batching with chunked prefill):

1. Running requests first, oldest first. Each takes its pending tokens — one
   for a decode, the rest of its prompt (up to the budget) for a prefill — so
   prefill chunks and decodes share a step. When pages run out, the newest
   running request is preempted by recompute: its slot and pages are freed, it
   returns to the front of the waiting queue, and later replays its prompt and
   the tokens it had produced.
2. Then waiting requests in arrival order (FCFS; or by priority, queue_order.py), while the token budget,
   ``max_num_seqs``, slots and pages allow. The head of the queue is never
   skipped, so a long prompt is not starved by short ones behind it; it is
   prefilled in chunks across steps.

Accounting is optimistic, so the host can plan step N+1 while step N runs (the
overlapped loop): scheduling a chunk commits it (``num_computed`` advances) and a
row that samples appends placeholder outputs (None), one per token it may emit
(1 + its drafts, as if all were accepted), that :meth:`update` fills when the
step's tokens arrive, dropping those of rejected drafts. Requests that hit ``max_tokens`` are known at
scheduling time and are not scheduled again; a stop on EOS or a stop token is
only known from the token, so the request may have run one extra step, whose
placeholder is then dropped.

Its output is a list of (request, number of new tokens); ``plan.py`` packs it
into numpy arrays for the device. No JAX here.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass

from deepinfer.scheduler import prefix_steps
from deepinfer.scheduler.allocators import OutOfPages, PageAllocator, SlotAllocator
from deepinfer.scheduler.prefix_cache import CacheSettings, PrefixCache
from deepinfer.scheduler.queue_order import admit, check_policy, enqueue
from deepinfer.scheduler.request import Request, RequestStatus
from deepinfer.scheduler.speculation import (
    SpecStats,
    drafts_available,
    min_tokens_uncertain,
    num_drafts_for,
    plan_speculation,
)
from deepinfer.scheduler.step_plan import StepPlan


@dataclass(frozen=True)
class PoolSpec:
    """A paged pool of compressed rows: one row per ``ratio`` tokens, ``page_size`` rows a page."""

    name: str
    ratio: int
    page_size: int
    num_pages: int

    def pages_for(self, num_tokens: int) -> int:
        rows = num_tokens // self.ratio
        return -(-rows // self.page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_slots: int
    pools: tuple[PoolSpec, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 0  # > 0: decode rows may carry up to this many drafts (speculation.py)
    prefix_cache: CacheSettings | None = None  # None: prefix caching off
    scheduling_policy: str = "fcfs"  # or "priority" (queue_order.py)

    def __post_init__(self):
        check_policy(self.scheduling_policy)
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_slots"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.slots = SlotAllocator(config.num_slots)
        self.pools = {p.name: PageAllocator(p.name, p.num_pages) for p in config.pools}
        self._specs = {p.name: p for p in config.pools}
        self.cache = None
        if config.prefix_cache is not None:
            spans = {p.name: (p.ratio, p.page_size) for p in config.pools}
            self.cache = PrefixCache(config.prefix_cache, self.pools, spans)
        self._queued_saves: list[tuple[int, int]] = []  # snapshots to take before the next step
        for spec in config.pools:  # so that any single admitted request can always run
            if spec.pages_for(config.max_model_len) > spec.num_pages:
                raise ValueError(f"pool {spec.name!r} cannot hold even one request of max_model_len tokens")
        self._arrivals = 0
        self.num_preemptions = 0
        self.spec_stats = SpecStats()
        # seconds per step by (tokens, rows, draft depth, grid width), measured by the engine at warm-up and
        # refined in the loop (step_cost.StepCostModel); with it, drafts are confidence-scheduled
        # (speculation.plan_speculation), without it every eligible row verifies k
        self.step_cost = None
        # tokens a step may hold: lowered by the engine while a background warm-up compiles
        self.token_budget = config.max_num_batched_tokens

    # -- requests in and out -------------------------------------------------

    def add_request(self, req: Request) -> None:
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id}: the prompt is empty")
        if len(req.prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"request {req.request_id}: prompt of {len(req.prompt_token_ids)} tokens leaves no room to "
                f"generate within max_model_len {self.config.max_model_len}"
            )
        req.arrival = self._arrivals
        self._arrivals += 1
        req.status = RequestStatus.WAITING
        enqueue(self.waiting, req, self.config.scheduling_policy)

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Remove req wherever it is and free its slot and pages at once."""
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        if not req.is_finished:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------

    def _draft_limits(self) -> tuple[dict[str, int] | None, int | None]:
        """Per request, how many drafts confidence scheduling lets it verify, and the draft depth
        (None, None: no limit but k, drafts k)."""
        limit = self.config.num_speculative_tokens
        if not limit or self.step_cost is None:
            return None, None
        budget = self.token_budget
        base = min(budget, sum(r.num_pending for r in self.running))
        cands, steady = [], []
        for r in self.running:
            cap = num_drafts_for(r, limit, budget, self.config.max_model_len, limit)  # by its limits alone
            if cap:
                cands.append((r, cap, drafts_available(r, limit)))
        # the steady state: the running requests and those that may be admitted now, all decoding
        admissible = list(itertools.islice(self.waiting, max(0, self.config.max_num_seqs - len(self.running))))
        for r in self.running + admissible:
            cap = num_drafts_for(r, limit, budget, self.config.max_model_len, limit, decoding=True)
            if cap:
                steady.append((r, cap))
        # the engine's model (step_cost.py) prices tokens by bucket: the planner asks only at bucket edges
        buckets = getattr(self.step_cost, "token_buckets", None)
        return plan_speculation(cands, base, max(len(self.running), 1), steady, self.step_cost,
                                self.spec_stats.position_rates(), limit, buckets)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.token_budget
        limits, depth = self._draft_limits()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._out_of_length(req):
                i += 1  # its last token is still in flight; it finishes when that arrives
                continue
            # overlap: the step that samples for req may still be in flight (not read yet)
            prior = req.in_flight_plan
            prior_drafts = len(prior.drafts.get(req.request_id, ())) if prior is not None else 0
            if min_tokens_uncertain(req, prior_drafts):
                i += 1  # whether its EOS is still blocked depends on that step: wait for it
                continue
            limit = self.config.num_speculative_tokens if limits is None else limits.get(req.request_id, 0)
            k = num_drafts_for(req, limit, budget, self.config.max_model_len,
                               drafts_available(req, self.config.num_speculative_tokens))
            n = prefix_steps.chunk_end(self.cache, req, min(req.num_pending, budget)) + k
            if not self._grow_or_preempt(req, n, plan):
                continue  # req itself was preempted; the list shifted
            if prior_drafts:
                plan.follows.add(req.request_id)
            plan.add(req, n, [None] * k if prior is not None else req.drafts[:k])
            if depth is not None:
                plan.draft_depth[req.request_id] = depth
            budget -= n
            i += 1
        if plan.preempted:
            return self._finish_plan(plan)  # memory is short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.slots.num_free == 0:
                break
            hit = prefix_steps.lookup(self.cache, req)
            copies = prefix_steps.admit(self.cache, req, hit) if hit is not None else None
            if copies is None:
                hit = None
            n = prefix_steps.chunk_end(self.cache, req, min(req.num_pending, budget))
            if not self._can_grow(req, n):
                if hit is not None:
                    prefix_steps.undo(self.cache, req, hit)
                break  # FCFS: never skip the head of the queue
            req.slot = self.slots.allocate()
            prefix_steps.account(self.cache, req, hit)
            if hit is not None:
                prefix_steps.plan_restore(plan.cache, req, hit, copies)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self._grow(req, n)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            admit(self.running, req, self.config.scheduling_policy)
            plan.add(req, n)
            if depth is not None:
                plan.draft_depth[req.request_id] = depth
            budget -= n
        return self._finish_plan(plan)

    def _finish_plan(self, plan: StepPlan) -> StepPlan:
        """Snapshots queued so far run before this step; what it computes is cached after it."""
        plan.cache.saves, self._queued_saves = self._queued_saves, []
        if self.cache is not None:
            prefix_steps.after_schedule(self.cache, plan, self._queued_saves)
            self.cache.pinned.clear()  # the restores are in this plan: nothing can overwrite them before
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Record a step's sampled tokens into their placeholders. Returns the requests that finished.

        A row that verified k drafts gets a list: the accepted drafts and one more token
        from the target; the rejected drafts are rolled back (``num_computed`` lowered)."""
        finished = []
        self.locate_outputs(plan)
        for req, _ in plan.scheduled:
            rid = req.request_id
            if req.in_flight_plan is plan:
                req.in_flight_plan = None
            if req.is_finished or rid not in plan.outputs:
                continue  # finished earlier (a late result of an extra step), or a mid-prompt chunk
            got = sampled[rid]
            tokens = [int(t) for t in got] if isinstance(got, (list, tuple)) else [int(got)]
            k = len(plan.drafts.get(rid, ()))
            if k:
                if req.status == RequestStatus.RUNNING:  # (a preempted one recomputes from 0)
                    req.num_computed -= k - (len(tokens) - 1)
                req.num_draft_tokens += k
                req.num_accepted_tokens += len(tokens) - 1
                self.spec_stats.record(k, len(tokens) - 1)
            first = index = plan.outputs[rid]  # this step's k + 1 placeholders start here
            req.output_token_ids[index] = tokens[0]
            reason = self._finish_reason(req, index)
            for t in tokens[1:]:
                if reason:
                    break  # tokens past a stop are never emitted
                index += 1
                req.output_token_ids[index] = t
                reason = self._finish_reason(req, index)
            del req.output_token_ids[index + 1 : first + k + 1]  # placeholders of rejected drafts
            if reason:
                del req.output_token_ids[index + 1 :]  # placeholders of steps run past the stop
                if req.status == RequestStatus.RUNNING:
                    self.running.remove(req)
                    if self.cache is not None:  # a multi-turn chat continues from here
                        prefix_steps.on_leave(self.cache, req, self._queued_saves)
                elif req.status == RequestStatus.WAITING:
                    self.waiting.remove(req)  # preempted while its last token was in flight
                self._release(req)
                req.status, req.finish_reason = RequestStatus.FINISHED, reason
                finished.append(req)
        return finished

    @staticmethod
    def locate_outputs(plan: StepPlan) -> None:
        """Where each sampling row's outputs go: its request's first placeholder (placeholders are
        filled in step order, so they are always the last outputs). The index the plan recorded
        assumed every draft of an earlier step in flight was accepted (overlap)."""
        for req, _ in plan.scheduled:
            if req.request_id in plan.outputs and not req.is_finished:
                first = req.num_resolved
                if first < len(req.output_token_ids):
                    plan.outputs[req.request_id] = first

    def check_all_free(self) -> None:
        """Allocator invariant with no request left: every slot free, every page free or cached."""
        self.slots.check_all_free()
        if self.running:
            raise AssertionError(f"requests still running: {[r.request_id for r in self.running]}")
        self.check_invariant()

    def check_invariant(self) -> None:
        """Every page is free, held by requests or held by cache blocks, its reference count the
        number of holders; running requests own distinct slots."""
        expected = {name: [0] * pool.num_pages for name, pool in self.pools.items()}
        for req in self.running:
            for name, pages in req.pages.items():
                for page in pages:
                    expected[name][page] += 1
        if self.cache is not None:
            for name, refs in self.cache.page_refs().items():
                for page, n in refs.items():
                    expected[name][page] += n
        for name, pool in self.pools.items():
            pool.check_refs(expected[name])
        slots = [r.slot for r in self.running]
        if len(set(slots)) != len(slots) or None in slots:
            raise AssertionError(f"running requests' slots are not distinct: {slots}")

    def reset_cache(self) -> None:
        """The device state was rebuilt: cached pages and snapshots are gone (requests hold none)."""
        self._queued_saves = []
        if self.cache is not None:
            self.cache.clear()

    # -- internals --------------------------------------------------------------

    def _finish_reason(self, req: Request, index: int) -> str | None:
        """Why output ``index`` ends the request, if it does."""
        token = req.output_token_ids[index]
        sp = req.sampling_params
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.config.eos_token_ids):
            return "stop"
        if sp.max_tokens is not None and index + 1 >= sp.max_tokens:
            return "length"
        if len(req.prompt_token_ids) + index + 1 >= self.config.max_model_len:
            return "length"
        return None

    def _out_of_length(self, req: Request) -> bool:
        """No further token is allowed: max_tokens or max_model_len reached (counting tokens in flight)."""
        sp = req.sampling_params
        return (sp.max_tokens is not None and len(req.output_token_ids) >= sp.max_tokens) or (
            req.num_tokens >= self.config.max_model_len
        )

    def _pages_missing(self, req: Request, n: int) -> dict[str, int]:
        end = req.num_computed + n
        return {name: spec.pages_for(end) - len(req.pages.get(name, ())) for name, spec in self._specs.items()}

    def _can_grow(self, req: Request, n: int) -> bool:
        """Whether req can get pages for n more tokens (evicting cached pages nobody holds if needed)."""
        missing = self._pages_missing(req, n)
        if self.cache is not None:
            for name, m in missing.items():
                if m > self.pools[name].num_free:
                    self.cache.evict(name, m)
        return all(m <= self.pools[name].num_free for name, m in missing.items())

    def _grow(self, req: Request, n: int) -> None:
        for name, missing in self._pages_missing(req, n).items():
            if missing > 0:
                req.pages.setdefault(name, []).extend(self.pools[name].allocate(missing))

    def _grow_or_preempt(self, req: Request, n: int, plan: StepPlan) -> bool:
        """Give req pages for n more tokens, preempting the newest running requests if needed.
        False when req itself had to be preempted."""
        while not self._can_grow(req, n):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False
        try:
            self._grow(req, n)
        except OutOfPages as e:  # _can_grow said yes: a bookkeeping bug, not a user error
            raise AssertionError(str(e)) from None
        return True

    def preempt(self, req: Request) -> None:
        """Send a running request back to the front of the queue to recompute later (its outputs kept)."""
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self.cache is not None:  # it resumes from its own snapshot
            prefix_steps.on_leave(self.cache, req, self._queued_saves)
        self._release(req)
        req.num_computed = 0
        req.drafts, req.draft_confidence = [], []
        req.in_flight_plan = None  # it replays from 0: no row of it follows that step
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        enqueue(self.waiting, req, self.config.scheduling_policy, preempted=True)

    def _release(self, req: Request) -> None:
        for name, pages in req.pages.items():
            self.pools[name].free(pages)
        req.pages = {}
        req.shared_until = req.history_start = 0
        if self.cache is not None:
            self.cache.release(req.cache_nodes)
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
