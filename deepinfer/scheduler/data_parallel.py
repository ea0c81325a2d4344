"""Attention data-parallel, the host side: one Scheduler per "dp" rank behind the Scheduler's face.

Each rank owns ``max_num_seqs`` slots, its own page pools, its own prefix cache and token
budget (vLLM / SGLang: every DP rank is a scheduler of its own), so a request's slot and pages are
that rank's local ids, which is what the rank's part of the step reads (runtime/data_parallel.py
packs each rank's plan separately). A new request goes to the rank whose prefix cache holds the
longest prefix of it, ties to the least-loaded rank (fewest requests), then the lowest.

``schedule()`` asks every rank and returns one StepPlan over all of them (rows rank by rank) whose
``parts`` are the ranks' own plans; the parts share the composite's per-request dicts (keys are
request ids), so whatever the engine records on the composite the ranks see. Device operations of
the prefix cache are translated to global ids (rank r's slot s is slot r * S + s of the engine
state, its page p page r * P + p, its snapshot entry e entry r * E + e). Host only.
"""

from __future__ import annotations

import collections
import dataclasses

from deepinfer.scheduler import prefix_steps
from deepinfer.scheduler.prefix_cache import common_prefix
from deepinfer.scheduler.scheduler import Scheduler, SchedulerConfig
from deepinfer.scheduler.speculation import SpecStats
from deepinfer.scheduler.step_plan import StepPlan


@dataclasses.dataclass(frozen=True)
class SlotTotals:
    """The ranks' slot allocators summed (what engine statistics read of ``slots``)."""

    num_slots: int = 0
    num_free: int = 0


class DataParallelScheduler:
    def __init__(self, config: SchedulerConfig, num_ranks: int):
        self.config = config
        self.ranks = [Scheduler(config) for _ in range(num_ranks)]
        self.spec_stats = SpecStats()  # one acceptance record: every rank drafts with the same model
        for rank in self.ranks:
            rank.spec_stats = self.spec_stats
        self._seq = 0

    # -- what the engine sets on its scheduler ------------------------------------

    @property
    def step_cost(self):
        return self.ranks[0].step_cost

    @step_cost.setter
    def step_cost(self, model) -> None:
        for rank in self.ranks:
            rank.step_cost = model

    @property
    def token_budget(self) -> int:
        return self.ranks[0].token_budget

    @token_budget.setter
    def token_budget(self, n: int) -> None:
        for rank in self.ranks:  # each rank's part of a step has the token bucket to itself
            rank.token_budget = n

    # -- requests -----------------------------------------------------------------

    def add_request(self, req) -> None:
        req.dp_rank = self.place(req)
        req.dp_order = self._seq
        self._seq += 1
        self.ranks[req.dp_rank].add_request(req)

    def place(self, req) -> int:
        """Where req goes (SGLang's cache-aware routing with its balance guard, in one process). Among
        the ranks holding at most ``num_slots // 2`` requests more than the least busy one (a prefix
        hit saves one prefill; a queue longer by half a batch costs every request in it more), the
        rank with the longest prefix of req cached, or in flight: a request queued or running there
        whose prompt starts with the same whole blocks (its blocks are cached once it is prefilled,
        so req and its followers meet them on that rank); then the longer cached part, then the
        fewest requests, then the lowest rank."""
        loads = [len(rank.running) + len(rank.waiting) for rank in self.ranks]
        slack = max(1, self.config.num_slots // 2)
        eligible = [i for i, load in enumerate(loads) if load <= min(loads) + slack]

        def score(i):
            rank = self.ranks[i]
            if rank.cache is None:
                return 0, 0, loads[i], i
            cached = prefix_steps.peek(rank.cache, req)
            flight = _shared_in_flight(req, [*rank.running, *rank.waiting], rank.cache.settings.block_size)
            return -max(cached, flight), -cached, loads[i], i

        return min(eligible, key=score)

    def abort(self, req, reason: str = "abort") -> None:
        self.ranks[req.dp_rank].abort(req, reason)

    def preempt(self, req) -> None:
        self.ranks[req.dp_rank].preempt(req)

    @property
    def has_unfinished(self) -> bool:
        return any(rank.has_unfinished for rank in self.ranks)

    @property
    def running(self) -> list:
        return [r for rank in self.ranks for r in rank.running]

    @property
    def waiting(self) -> collections.deque:
        """Every rank's queue, in the order requests arrived (a view: assign to reorder)."""
        return collections.deque(sorted((r for rank in self.ranks for r in rank.waiting), key=lambda r: r.dp_order))

    @waiting.setter
    def waiting(self, requests) -> None:
        requests = list(requests)
        for i, rank in enumerate(self.ranks):
            rank.waiting = collections.deque(r for r in requests if r.dp_rank == i)

    @property
    def num_preemptions(self) -> int:
        return sum(rank.num_preemptions for rank in self.ranks)

    @property
    def slots(self) -> SlotTotals:
        return SlotTotals(sum(r.slots.num_slots for r in self.ranks), sum(r.slots.num_free for r in self.ranks))

    # -- steps --------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        return self.combine([rank.schedule() for rank in self.ranks])

    def combine(self, parts: list[StepPlan]) -> StepPlan:
        """One plan over the ranks' plans (see the module's docstring)."""
        plan = StepPlan()
        plan.parts = parts
        for i, part in enumerate(parts):
            plan.scheduled += part.scheduled
            plan.preempted += part.preempted
            for name in ("starts", "outputs", "drafts", "draft_depth"):
                getattr(plan, name).update(getattr(part, name))
            plan.follows |= part.follows
            self._translate(i, part.cache, plan.cache)
        for part in parts:  # one set of per-request records: the engine updates the composite's
            part.starts, part.outputs, part.drafts, part.draft_depth = (plan.starts, plan.outputs, plan.drafts,
                                                                         plan.draft_depth)
            part.follows = plan.follows
        return plan

    def _translate(self, i: int, ops: prefix_steps.CacheOps, into: prefix_steps.CacheOps) -> None:
        """Rank i's cache operations in the engine state's global slots, pages and snapshot entries."""
        s, e = self.config.num_slots * i, self._entries(i) * i
        pages = {p.name: p.num_pages * i for p in self.config.pools}
        into.saves += [(s + slot, e + entry) for slot, entry in ops.saves]
        into.restores += [(s + slot, e + entry) for slot, entry in ops.restores]
        into.clears += [s + slot for slot in ops.clears]
        into.copies += [(pool, pages[pool] + a, pages[pool] + b) for pool, a, b in ops.copies]
        into.marks += [(s + slot, token, out) for slot, token, out in ops.marks]

    def _entries(self, i: int) -> int:
        cache = self.ranks[i].cache
        return max(cache.settings.num_snapshots, 1) if cache is not None else 0

    def update(self, plan: StepPlan, sampled: dict) -> list:
        return [r for rank, part in zip(self.ranks, self.parts_of(plan)) for r in rank.update(part, sampled)]

    def parts_of(self, plan: StepPlan) -> list[StepPlan]:
        """The ranks' plans of a composite (an empty plan, as warm-up dispatches: empty parts)."""
        return getattr(plan, "parts", None) or [StepPlan() for _ in self.ranks]

    @staticmethod
    def locate_outputs(plan: StepPlan) -> None:
        Scheduler.locate_outputs(plan)  # (the parts share the composite's outputs)

    def check_all_free(self) -> None:
        for rank in self.ranks:
            rank.check_all_free()

    def check_invariant(self) -> None:
        for rank in self.ranks:
            rank.check_invariant()

    def reset_cache(self) -> None:
        for rank in self.ranks:
            rank.reset_cache()


def _shared_in_flight(req, others, block_size: int) -> int:
    """The longest run of whole blocks that req's prompt shares with the prompt of one of ``others``
    (same cache salt only: tenants share nothing)."""
    prompt, best = req.prompt_token_ids, 0
    for other in others:
        if other.cache_salt != req.cache_salt:
            continue
        best = max(best, common_prefix(prompt, other.prompt_token_ids) // block_size * block_size)
    return best
