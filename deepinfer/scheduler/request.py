"""A request's life on the host: tokens, progress, the device resources it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from deepinfer.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request.

    ``num_computed`` counts the tokens (prompt, then outputs) whose state is on
    the device. Preemption by recompute drops the state and resets it to 0; the
    request later replays prompt + outputs so far and continues exactly where it
    was (sampling depends only on seed and position).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int = 0
    seed: int = 0
    priority: int = 0  # with scheduling_policy "priority": lower runs first (scheduler/queue_order.py)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    slot: int | None = None
    pages: dict[str, list[int]] = field(default_factory=dict)
    finish_reason: str | None = None
    num_preemptions: int = 0
    logits: list = field(default_factory=list)  # per generated token, only when the engine keeps them
    # output index -> (sampled logprob, top ids, top logprobs), when sampling_params.logprobs is set
    token_logprobs: dict[int, tuple[float, list[int], list[float]]] = field(default_factory=dict)
    # prompt position (>= 1) -> (logprob of that prompt token, top ids, top logprobs), when asked for
    prompt_logprobs: dict[int, tuple[float, list[int], list[float]]] = field(default_factory=dict)
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    first_scheduled_time: float | None = None  # time.monotonic() when first admitted to the batch
    # speculative decoding: the drafter's tokens after the last output (and their probabilities)
    drafts: list[int] = field(default_factory=list)
    draft_confidence: list[float] = field(default_factory=list)
    in_flight_plan: Any = None  # the dispatched, not yet read step that samples for it (overlap)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted
    # structured outputs: the request's grammar matcher (grammar/step_mask.RequestGrammar), host only
    grammar: Any = None
    # prefix caching (scheduler/prefix_cache.py): tenants with different salts share nothing
    cache_salt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the last admission skipped (vLLM's num_cached_tokens)
    shared_until: int = 0  # positions below write no pool rows: their rows are the cache's pages
    history_start: int = 0  # a replay from an empty slot state starts here (checkpoint-free mode)
    # attention data-parallel (scheduler/data_parallel.py): the rank that holds it (its slot and pages
    # are that rank's), and its place in the order requests arrived over all ranks
    dp_rank: int = 0
    dp_order: int = 0
    cache_nodes: list = field(default_factory=list)  # the cache blocks this request holds (hit or written)

    @property
    def num_resolved(self) -> int:
        """Output tokens known on the host (a step still in flight leaves placeholders at the end)."""
        n = len(self.output_token_ids)
        while n and self.output_token_ids[n - 1] is None:
            n -= 1
        return n

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens known on the host but not yet computed on the device."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
