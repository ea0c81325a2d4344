"""The step-cost model confidence-scheduled speculation plans with: seconds per step by token
bucket, row bucket, draft depth and sampling-grid width. Host only.

Warm-up times each bucket on the device alone (runtime/warmup.time_costs: the fastest of a few
interleaved passes, so the plain and speculating programs are timed under the same load). That is a first guess, not
what a step costs in the loop: there the host plans, packs and reads every step, and on a CPU
backend it shares the cores with the device's work, so speculation's own host work (planning,
reading drafts, rolling back) lands on the step too. So the engine reports each step's real
duration (``observe``) and the model serves, per key, the running mean of what was seen once a
key has been seen a few times; until then the warm-up figure, scaled by how far the loop's
observed steps of the same kind (plain: depth 0 and width 1; or speculative) are from their
warm-up figures (the median ratio). The two kinds are scaled apart because speculation's host
work is what the warm-up timing misses: a plain step is not dearer because speculative ones
proved so. A depth that looked cheap at warm-up and proves dear in the loop is then no longer
chosen; one that looked dear is not tried, which errs on the side of a plain step.
"""

from __future__ import annotations

import statistics

from deepinfer.scheduler.buckets import bucket_of, rows_for

MIN_OBSERVATIONS = 3  # seen this often, a key's own mean replaces the scaled warm-up figure
SMOOTHING = 0.2  # weight of a new observation in a key's running mean


class StepCostModel:
    """``model(tokens, rows, depth, width)`` -> seconds; ``observe(key, seconds)`` refines it.

    ``warm``: seconds by (token bucket, row bucket, "depth", depth) at width 1, and by
    (token bucket, row bucket, "width", width) what a grid of that width adds at depth 1."""

    def __init__(self, warm: dict, token_buckets: tuple[int, ...], row_buckets: tuple[int, ...]):
        self.token_buckets, self.row_buckets = tuple(token_buckets), tuple(row_buckets)
        self._warm = dict(warm)
        self._worst = max(warm.values()) if warm else 1.0
        self._mean: dict[tuple, float] = {}
        self._seen: dict[tuple, int] = {}
        # several processes running one engine plan alike only from figures they share: there the model
        # keeps the warm-up figures process 0 measured (runtime/process_agreement.py) unless the
        # lockstep server ships process 0's observations (runtime/lockstep.py)
        self.frozen = False
        self._scale = {False: 1.0, True: 1.0}  # scale(kind) as of the last observation (recomputed only then)
        # what the planner computed from speculative prices alone (speculation.plan_speculation: the
        # steady-state values of depths >= 1), emptied whenever a speculative key's price may change
        self.speculative_values: dict = {}

    def key(self, n_tokens: int, n_rows: int, depth: int, width: int = 1) -> tuple[int, int, int, int]:
        t = bucket_of(max(n_tokens, n_rows), self.token_buckets)
        return t, rows_for(t, self.row_buckets), depth, max(width, 1)

    def warm_estimate(self, key: tuple[int, int, int, int]) -> float:
        t, r, depth, width = key
        extra = self._warm.get((t, r, "width", width), 0.0) if width > 1 else 0.0
        return self._warm.get((t, r, "depth", depth), self._worst) + extra

    @staticmethod
    def speculative(key: tuple[int, int, int, int]) -> bool:
        """A key's kind: True when the step drafts or verifies (depth > 0 or width > 1)."""
        return key[2] > 0 or key[3] > 1

    def scale(self, speculative: bool) -> float:
        """How far the loop's steps of one kind are from their warm-up figures (median over the
        keys of that kind seen enough; 1 before any)."""
        ratios = [self._mean[k] / self.warm_estimate(k) for k, n in self._seen.items()
                  if n >= MIN_OBSERVATIONS and self.speculative(k) == speculative and self.warm_estimate(k) > 0]
        return statistics.median(ratios) if ratios else 1.0

    def __call__(self, n_tokens: int, n_rows: int, depth: int, width: int = 1) -> float:
        key = self.key(n_tokens, n_rows, depth, width)
        if self._seen.get(key, 0) >= MIN_OBSERVATIONS:
            return self._mean[key]
        return self.warm_estimate(key) * self._scale[self.speculative(key)]

    def observe(self, key: tuple[int, int, int, int], seconds: float) -> None:
        """One step of this key took ``seconds`` in the loop (ignored when ``frozen``)."""
        if self.frozen:
            return
        n = self._seen.get(key, 0)
        self._mean[key] = seconds if n == 0 else (1 - SMOOTHING) * self._mean[key] + SMOOTHING * seconds
        self._seen[key] = n + 1
        if self.speculative(key):
            self.speculative_values.clear()
        if n + 1 >= MIN_OBSERVATIONS:
            kind = self.speculative(key)
            self._scale[kind] = self.scale(kind)

    def observed(self) -> dict[tuple, tuple[float, int]]:
        """(running mean seconds, times seen) by key."""
        return {k: (self._mean[k], n) for k, n in self._seen.items()}
