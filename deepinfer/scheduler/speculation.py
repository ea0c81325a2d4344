"""Host side of speculative decoding: which requests verify drafts this step, and how many.

A decode row of a request that holds drafts (from the previous step's drafter) carries
its known last token plus k drafts; the step verifies them and the host rolls back the
rejected ones (``num_computed`` lowered; the device state needs nothing, see
kv/rollback.py). k never lets a step emit past max_tokens or max_model_len.

Verification (runtime/sampler.verify_sample) is exact for greedy and sampled requests
(temperature, top-k / top-p / min-p, logit bias, logprobs, grammars): emitted tokens are
distributed as without speculation (greedy: identical), and logprobs come from the raw
logits at each verified position. Requests with penalties do not take drafts (those would
need per-position counts) and run as plain decode rows in the same steps; a request whose
min_tokens is pending verifies only drafts that stay before it (its stop block is per row).

Confidence-scheduled verification (``EngineConfig.mtp_varlen``, env DEEPINFER_ENABLE_MTP_VARLEN=1):
each draft position's chance of being accepted is estimated by its survival product, the
drafter's own probabilities of the drafts up to it (one step old: they come with the
drafts). ``plan_drafts`` then picks, over the whole step, the draft tokens to verify so
that expected progress per second is highest under the step-cost model the engine
measured at warm-up (seconds per step by token and row count). When steps are
compute-bound (many rows), adding tokens costs time and little or nothing is verified.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from deepinfer.scheduler.request import Request

MAX_DRAFT_TOKENS = 5  # the product's cap (DEEPINFER_USE_NEXTN_DECODE <= 5)


def speculation_ok(req: Request) -> bool:
    """Penalties need the counts of the drafts before each verified position (not kept): no drafts."""
    return not req.sampling_params.uses_penalties


def num_drafts_for(req: Request, limit: int, budget: int, max_model_len: int) -> int:
    """How many of req's drafts this step verifies (0: a plain decode)."""
    if not limit or not req.drafts or req.num_pending != 1 or not speculation_ok(req):
        return 0
    sp = req.sampling_params
    room = max_model_len - req.num_tokens - 1  # the step emits up to k + 1 tokens
    if sp.max_tokens is not None:
        room = min(room, sp.max_tokens - len(req.output_token_ids) - 1)
    outputs = len(req.output_token_ids)
    if outputs < sp.min_tokens:
        # the row blocks EOS / stop ids at every verified position (one bias per row): right only
        # while every one of them is still before min_tokens
        room = min(room, sp.min_tokens - outputs - 1)
    return max(0, min(limit, len(req.drafts), room, budget - 1))


@dataclass
class SpecStats:
    """Counters since start, with vLLM's meanings: a draft is one verified row."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def plan_drafts(cands: list[tuple[Request, int]], base_tokens: int, rows: int,
                step_cost: Callable[[int, int], float]) -> dict[str, int]:
    """Drafts to verify per request id. cands: (request, most drafts it may verify); base_tokens /
    rows: the step's work without drafts. Maximises (base_tokens + expected accepted drafts) /
    step_cost(base_tokens + drafts, rows); a request's chosen drafts are always its first ones."""
    gains = []
    for req, cap in cands:
        survival = 1.0
        for i in range(cap):
            survival *= min(max(float(req.draft_confidence[i]), 0.0), 1.0)
            gains.append((survival, -i, req.request_id))
    gains.sort(reverse=True)  # a request's later positions never come before its earlier ones
    best_m, best = 0, base_tokens / step_cost(base_tokens, rows)
    expected = 0.0
    for m, (gain, _, _) in enumerate(gains, 1):
        expected += gain
        value = (base_tokens + expected) / step_cost(base_tokens + m, rows)
        if value > best:
            best, best_m = value, m
    return dict(collections.Counter(rid for _, _, rid in gains[:best_m]))
