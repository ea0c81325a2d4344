"""Host side of speculative decoding: which requests verify drafts this step, and how many.

A decode row of a request that holds drafts (from the previous step's drafter) carries
its known last token plus k drafts; the step verifies them and the host rolls back the
rejected ones (``num_computed`` lowered; the device state needs nothing, see
kv/rollback.py). k never lets a step emit past max_tokens or max_model_len.

Verification is greedy (accept a draft while it equals the target's token), so only
requests whose every emitted token is the target's argmax of the raw logits take drafts:
temperature 0, no penalties, no logprobs, no min_tokens still blocking stops. The others
run as plain decode rows in the same steps. (Rejection sampling, penalties and logprobs at
every verified position are what remains of issue 14; see the session note.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.scheduler.request import Request

MAX_DRAFT_TOKENS = 5  # the product's cap (DEEPINFER_USE_NEXTN_DECODE <= 5)


def speculation_ok(req: Request) -> bool:
    sp = req.sampling_params
    return (
        sp.temperature == 0
        and not sp.uses_penalties
        and sp.logprobs is None
        and len(req.output_token_ids) >= sp.min_tokens
    )


def num_drafts_for(req: Request, limit: int, budget: int, max_model_len: int) -> int:
    """How many of req's drafts this step verifies (0: a plain decode)."""
    if not limit or not req.drafts or req.num_pending != 1 or not speculation_ok(req):
        return 0
    sp = req.sampling_params
    room = max_model_len - req.num_tokens - 1  # the step emits up to k + 1 tokens
    if sp.max_tokens is not None:
        room = min(room, sp.max_tokens - len(req.output_token_ids) - 1)
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
