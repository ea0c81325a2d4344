"""Host side of speculative decoding: which requests verify drafts this step, and how many.

A decode row of a request that holds drafts (from the previous step's drafter) carries
its known last token plus k drafts; the step verifies them and the host rolls back the
rejected ones (``num_computed`` lowered; the device state needs nothing, see
kv/rollback.py). k never lets a step emit past max_tokens or max_model_len.

Verification (runtime/sampler.verify_sample) is exact for greedy and sampled requests
(temperature, top-k / top-p / min-p, logit bias, logprobs, grammars): emitted tokens are
distributed as without speculation (greedy: identical), and logprobs come from the raw
logits at each verified position; penalties at position j count the outputs before j (the
drafts after it are taken out of the slot's counts there). A request whose min_tokens is
pending verifies only drafts that stay before it (its stop block is per row).

With overlap the host plans step N+1 before it has read step N: a request whose step N verified
drafts is planned as if every one was accepted (its placeholders, num_computed and pages count
them all), its row is flagged ``follows`` and its drafts are placeholders the device reads from
the slot's own buffer; the device moves the row's positions by what step N really accepted
(runtime/paged_step.follow_in_flight), and reading step N lowers num_computed by the rest.

Confidence-scheduled verification (``EngineConfig.mtp_varlen``, env DEEPINFER_ENABLE_MTP_VARLEN=1):
each draft position's chance of being accepted is estimated by its survival product, the
drafter's own probabilities of the drafts up to it (one step old: they come with the
drafts). ``plan_drafts`` then picks, over the whole step, the draft tokens to verify so
that expected progress per second is highest under the step-cost model the engine
measured at warm-up (seconds per step by tokens, rows, draft depth and the sampling grid's
width) and refines with each step's duration in the loop (step_cost.py). When steps are
compute-bound (many rows), adding tokens costs time and little or nothing is verified. The drafter's depth is chosen with it (``plan_speculation``), down to 0:
at high load the drafter is skipped, feeding included, and a step costs a plain one.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from deepinfer.scheduler.buckets import bucket_of
from deepinfer.scheduler.request import Request

MAX_DRAFT_TOKENS = 5  # the product's cap (DEEPINFER_USE_NEXTN_DECODE <= 5)
# how much more expected progress per second a draft depth >= 1 must promise than depth 0 to be chosen.
# Measured (benchmarks/spec_decode.py, c = 4, 2026-12-07, without it): the planner chose depth 1, and the
# engine read 0.91x of plain beside it; the machine's step times scatter by about 10 % between runs.
SPECULATION_MARGIN = 1.1


def drafts_available(req: Request, num_speculative_tokens: int) -> int:
    """Drafts req could verify now: those read from its last step, or, when that step is still in
    flight (overlap), as many as that step asked the drafter for (k unless confidence scheduling
    chose a depth), which the device holds for its slot."""
    if req.in_flight_plan is not None:
        return req.in_flight_plan.draft_depth.get(req.request_id, num_speculative_tokens)
    return len(req.drafts)


def num_drafts_for(req: Request, limit: int, budget: int, max_model_len: int, available: int | None = None,
                   decoding: bool = False) -> int:
    """How many of req's drafts this step verifies (0: a plain decode). ``available``: drafts
    there are (default: those read from its last step); ``decoding``: as if req were decoding
    now (the steady state confidence scheduling plans the draft depth for), its prompt or not."""
    available = len(req.drafts) if available is None else available
    if not limit or not available or (req.num_pending != 1 and not decoding):
        return 0
    sp = req.sampling_params
    # counts below include the placeholders of a step in flight, as if it accepted every draft
    room = max_model_len - req.num_tokens - 1  # the step emits up to k + 1 tokens
    if sp.max_tokens is not None:
        room = min(room, sp.max_tokens - len(req.output_token_ids) - 1)
    outputs = len(req.output_token_ids)
    if outputs < sp.min_tokens:
        # the row blocks EOS / stop ids at every verified position (one bias per row): right only
        # while every one of them is still before min_tokens
        room = min(room, sp.min_tokens - outputs - 1)
    return max(0, min(limit, available, room, budget - 1))


def min_tokens_uncertain(req: Request, in_flight_drafts: int) -> bool:
    """Whether req's next output may or may not be before min_tokens, depending on how many drafts
    its step in flight accepts: its EOS block cannot be decided, so it waits for that step."""
    high = len(req.output_token_ids)  # the next output's index if every draft in flight is accepted
    return in_flight_drafts > 0 and high - in_flight_drafts < req.sampling_params.min_tokens <= high


@dataclass
class SpecStats:
    """Counters since start, with vLLM's meanings: a draft is one verified row."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    # verified drafts at each position whose earlier drafts were all accepted (so it was decided)
    reached_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)

    def position_rates(self) -> list[float]:
        """Per draft position, the share of the drafts verified there (their earlier ones
        accepted) that were accepted; 0.5 before any evidence. A position never verified keeps
        0.5, so a depth that was not tried yet is not ruled out by never being tried."""
        return [a / r if r else 0.5 for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        for i in range(min(k, accepted + 1)):
            self.reached_per_position[i] += 1


def plan_drafts(cands: list[tuple[Request, int]], base_tokens: int, rows: int,
                step_cost: Callable[[int, int, int], float], prior: list[float] | None = None,
                token_buckets: tuple[int, ...] | None = None) -> dict[str, int]:
    """Drafts to verify per request id. cands: (request, most drafts it may verify); base_tokens /
    rows: the step's work without drafts. Maximises (base_tokens + expected accepted drafts) /
    step_cost(base_tokens + drafts, rows, width), width being 1 + the most drafts one row verifies
    (the sampling grid's); a request's chosen drafts are always its first ones. A draft's
    confidence is the request's last read one (one step old with overlap); ``prior`` per
    position where it has none (its first drafts, not read yet). ``token_buckets``: step_cost
    depends on tokens only through these (so it is asked only where its answer can change)."""
    return _best(cands, base_tokens, rows, step_cost, prior, token_buckets)[0]


def _best(cands, base_tokens: int, rows: int, step_cost, prior,
          token_buckets: tuple[int, ...] | None = None) -> tuple[dict[str, int], float]:
    """plan_drafts' choice and its value (expected tokens per second)."""
    gains = []
    for req, cap in cands:
        survival = 1.0
        for i in range(cap):
            own = i < len(req.draft_confidence)
            conf = req.draft_confidence[i] if own else (prior or [0.5] * (i + 1))[i]
            survival *= min(max(float(conf), 0.0), 1.0)
            gains.append((survival, -i, req.request_id))
    gains.sort(reverse=True)  # a request's later positions never come before its earlier ones
    best_m, best = 0, base_tokens / step_cost(base_tokens, rows, 1)
    expected, width = 0.0, 1
    for m, (gain, neg_i, _) in enumerate(gains, 1):
        expected += gain
        width = max(width, 2 - neg_i)  # this draft is its request's position -neg_i (from 0)
        if token_buckets is not None and m < len(gains) and gains[m][0] > 0:
            # one more draft that earns something at the same cost (same bucket, same width) is
            # better than this plan: the step cost is asked only where it may change (host time)
            if max(width, 2 - gains[m][1]) == width and (bucket_of(base_tokens + m, token_buckets)
                                                         == bucket_of(base_tokens + m + 1, token_buckets)):
                continue
        value = (base_tokens + expected) / step_cost(base_tokens + m, rows, width)
        if value > best:
            best, best_m = value, m
    return dict(collections.Counter(rid for _, _, rid in gains[:best_m])), best


def plan_speculation(cands: list[tuple[Request, int, int]], base_tokens: int, rows: int,
                     steady: list[tuple[Request, int]], step_cost: Callable[[int, int, int, int], float],
                     prior: list[float] | None, max_depth: int,
                     token_buckets: tuple[int, ...] | None = None) -> tuple[dict[str, int], int]:
    """Confidence scheduling of one step -> (drafts to verify per request id, draft depth).

    cands: (request, most drafts it may verify now by its limits, drafts it has now); steady:
    (request, most drafts it could verify were it decoding) for every running request.
    step_cost(tokens, rows, depth, width): seconds per step (depth 0: the drafter skipped,
    feeding included). The depth D (drafts the drafter makes, for the next step; the device loop
    runs D - 1 MTP passes whatever the rows) is the one whose steady state pays best (a D >= 1 by
    SPECULATION_MARGIN over D = 0): every
    running request decoding and verifying up to D drafts at depth D's cost, each position
    accepted as often as measured so far (``prior``: the drafter's own confidences are one step
    old with overlap, and of other drafts). This step then verifies, among the drafts there are,
    what pays at depth D, ranked by the requests' confidences. So drafting costs are weighed
    against what they earn: at high load D is 0 and a step costs what it does without
    speculation; a prompt is fed to the drafter when its request will draft."""
    def at(depth):
        return lambda n, r, w: step_cost(n, r, depth, w)

    n = max(len(steady), 1)
    caps = [cap for _, cap in steady]
    values = {0: _steady_value([0] * len(caps), n, at(0), prior, token_buckets)}
    memo = _speculative_memo(step_cost)
    for d in range(1, max_depth + 1):
        capped = [min(cap, d) for cap in caps]
        key = (d, n, tuple(sorted(capped)), tuple(prior or ()), token_buckets)
        value = memo.get(key) if memo is not None else None
        if value is None:
            value = _steady_value(capped, n, at(d), prior, token_buckets)
            if memo is not None:
                memo[key] = value
        values[d] = value
    # a depth >= 1 must beat depth 0 by SPECULATION_MARGIN: its figures are estimates (warm-up timings
    # of another program, running means of a noisy loop), and a speculative step also pays host work
    # they miss (planning, reading drafts, rolling back)
    depth = max(values, key=lambda d: (values[d] / (SPECULATION_MARGIN if d else 1.0), -d))
    # drafts already made are verified if they pay, whatever the depth for the next step
    return plan_drafts([(req, min(cap, have)) for req, cap, have in cands], base_tokens, rows, at(depth),
                       prior, token_buckets), depth


def _speculative_memo(step_cost) -> dict | None:
    """Steady-state values of depths >= 1, kept while the model's speculative prices stay as they were
    (step_cost.StepCostModel.speculative_values, emptied when a speculative step is observed): such a
    depth's value reads only speculative keys (depth > 0), so while the planner keeps choosing depth 0,
    whose plain steps are all it observes, each step prices depth 0 alone. None for a cost function
    that keeps none (tests' lambdas)."""
    memo = getattr(step_cost, "speculative_values", None)
    if memo is not None and len(memo) > 4096:  # (bounded on a long run of plain steps)
        memo.clear()
    return memo


def _steady_value(caps: list[int], n: int, step_cost, prior: list[float] | None,
                  token_buckets: tuple[int, ...] | None) -> float:
    """The value ``_best`` finds for n decoding requests verifying up to caps[j] drafts each at the
    prior's chances (requests without confidences of their own) (expected tokens per second), without ranking every draft: all requests'
    drafts at one position are alike, and positions come in order (survival never grows), so the
    drafts taken are whole positions and part of the next; within a position the cost changes only
    at token-bucket edges (``token_buckets``; None: at every count), where the value is checked.

    When some request may draft (a depth >= 1), only plans that verify at least one draft count: a
    steady state that drafts and never verifies costs more than depth 0 and earns the same, but its
    price comes from another program's timing, and noise there (measured: depth 1 priced 1 % under
    depth 0 at 4 rows) would otherwise pick it, every step paying for drafts nobody verifies."""
    best = 0.0 if any(caps) else n / step_cost(n, n, 1)
    expected, taken, survival = 0.0, 0, 1.0
    for i in range(max(caps, default=0)):
        count = sum(1 for c in caps if c > i)
        survival *= min(max(float((prior or [0.5] * (i + 1))[i]), 0.0), 1.0)
        if token_buckets is None:
            ends = range(taken + 1, taken + count + 1)
        else:
            ends = sorted({taken + count} | {b - n for b in token_buckets if taken < b - n < taken + count})
        for end in ends:  # the first `end` drafts: whole positions, then part of position i
            best = max(best, (n + expected + (end - taken) * survival) / step_cost(n + end, n, i + 2))
        expected += count * survival
        taken += count
    return best
