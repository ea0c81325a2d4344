"""StepPlan: what one step runs, as the scheduler (scheduler.py) decides it and the packer
(plan.py), the engine and the prefix cache read it. Scheduling a row commits it at once
(optimistic accounting, so the host can plan the next step while this one runs). Host only."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.scheduler import prefix_steps
from deepinfer.scheduler.request import Request


@dataclass
class StepPlan:
    """What one step runs: (request, new tokens) in order, and who was preempted.

    ``starts[id]``: the request's computed length before this step; ``outputs[id]``:
    for rows that sample, the index of the first placeholder output the step fills (as planned;
    an earlier step's rejected drafts move it, Scheduler.locate_outputs);
    ``drafts[id]``: drafts the row verifies (its last tokens; counted in its n; None: still on
    the device, from the request's step in flight); ``follows``: ids whose step in flight verified
    drafts (their positions are shifted on the device by what it accepted, speculation.py).
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int | None]] = field(default_factory=dict)
    follows: set[str] = field(default_factory=set)
    draft_depth: dict[str, int] = field(default_factory=dict)  # drafts to make for the next step (default: k)
    cache: prefix_steps.CacheOps = field(default_factory=prefix_steps.CacheOps)  # run before the step
    # (token bucket, row bucket, draft depth, grid width) of the step as dispatched: the key its
    # measured duration refines the step-cost model under (step_cost.py)
    cost_key: tuple[int, int, int, int] | None = None
    # steps the plan's rows run in one dispatch (a decode burst: each row samples this many tokens,
    # scheduler/decode_burst.py); 1: an ordinary step
    burst: int = 1
    # attention data-parallel: the ranks' own plans this one combines (scheduler/data_parallel.py)
    parts: list | None = None
    output_rows: object = None  # and where its rows are in the step's logits, rank by rank (numpy [dp * R])

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def samples(self, req: Request, n: int | None = None) -> bool:
        """Whether this step produces a new token for req (its chunk reaches the end of its known tokens)."""
        return req.request_id in self.outputs

    def add(self, req: Request, n: int, drafts: list[int] | None = None) -> None:
        """Schedule n tokens of req (the last len(drafts) of them drafts) and commit them (optimistic accounting)."""
        self.scheduled.append((req, n))
        self.starts[req.request_id] = req.num_computed
        req.num_computed += n
        if drafts:
            self.drafts[req.request_id] = list(drafts)
        if req.num_computed - len(drafts or ()) == req.num_tokens:
            self.outputs[req.request_id] = len(req.output_token_ids)
            # placeholders until the step's tokens arrive: one per token it may emit (drafts + 1)
            req.output_token_ids.extend([None] * (1 + len(drafts or ())))
            req.in_flight_plan = self
