"""After a failed step: find the request(s) that made it fail, fail only those.

The engine state may have been donated to the failed call, so it is rebuilt and every
request recomputes from its tokens (sampling is a pure function of seed, position and
token id, so a replayed request produces exactly the tokens an undisturbed run would).
The failing step's requests are then probed in halves, each half alone on the rebuilt
state, until every failing half is a single request: that one is the culprit. A probe
passes once each of its requests has produced one more token (or finished) than before
the failure, i.e. it got past the point where the step failed. A failure that does not
come back (transient) fails nobody.

The probes run synchronously, without overlap: a failure is rare, and bystanders wait a
few steps rather than risk being blamed.
"""

from __future__ import annotations

import collections
import logging

from deepinfer.kv.paged_state import init_engine_state
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.scheduler import StepPlan

log = logging.getLogger("deepinfer.runtime.engine")


def reset(engine) -> None:
    """Rebuild the state and send every unfinished request back to recompute (outputs kept,
    placeholders of steps that never finished dropped)."""
    engine._inflight = None
    sched = engine.scheduler
    for req in list(sched.running)[::-1]:
        del req.output_token_ids[req.num_resolved :]
        sched.preempt(req)
    for req in sched.waiting:
        del req.output_token_ids[req.num_resolved :]
    engine.state = init_engine_state(engine.family, engine.cfg, engine.layout, engine.dtype)
    sched.reset_cache()  # cached pages and snapshots lived in the old state
    if engine.prefix is not None:
        engine.prefix.reset()


def probe(engine, group: list[Request]) -> Exception | None:
    """Run only ``group`` until each of its requests has one more output token (or finished).
    Returns the exception if a step fails (the state is reset then), None if the group passes.
    The rest of the queue waits, in its order, until the probe is over."""
    sched = engine.scheduler
    ids = {r.request_id for r in group}
    others = [r for r in sched.waiting if r.request_id not in ids]
    sched.waiting = collections.deque(r for r in sched.waiting if r.request_id in ids)
    target = {r.request_id: len(r.output_token_ids) + 1 for r in group}
    # every step computes at least one token, so this bounds the probe
    max_steps = sum(r.num_tokens for r in group) + 2
    error = None
    try:
        for _ in range(max_steps):
            todo = [r for r in group if not r.is_finished and r.num_resolved < target[r.request_id]]
            if not todo:
                break
            plan = sched.schedule()
            if not plan.scheduled:
                break
            try:
                outputs = engine._run(plan, engine._shape_for(plan))
                engine.num_steps += 1
                engine._process(plan, *outputs)
            except Exception as exc:  # noqa: BLE001 - any failure of the step is what we look for
                error = exc
                break
    finally:
        reset(engine)  # the group's state goes too: its requests recompute with the rest
        sched.waiting = collections.deque(list(sched.waiting) + others)  # (assigned: a data-parallel scheduler's is a view)
    return error


def isolate(engine, plans: list[StepPlan], exc: Exception) -> list[Request]:
    """Fail the request(s) of ``plans`` that make a step fail; the others go on. Returns the failed."""
    suspects = list({r.request_id: r for plan in plans for r, _ in plan.scheduled if not r.is_finished}.values())
    reset(engine)
    order = list(engine.scheduler.waiting)
    failed: list[Request] = []
    # groups known to fail on their own; first: does the failure come back at all?
    groups = [suspects] if probe(engine, suspects) is not None else []
    while groups:
        group = [r for r in groups.pop() if not r.is_finished]
        halves = [group[: len(group) // 2], group[len(group) // 2 :]] if len(group) > 1 else []
        failing = [h for h in halves if probe(engine, h) is not None]
        if failing:
            groups += failing
            continue
        # one request, or a group that fails only together: those are the cause
        for req in group:
            req.error = f"{type(exc).__name__}: {exc}"
            engine.abort(req, "error")
            failed.append(req)
    # the queue in its order before the failure (probes moved requests about)
    waiting = {r.request_id for r in engine.scheduler.waiting}
    engine.scheduler.waiting = collections.deque(r for r in order if r.request_id in waiting)
    log.error("step failed (%s: %s); failed %d request(s) (%s), kept the others", type(exc).__name__, exc,
              len(failed), ", ".join(r.request_id for r in failed) or "none: the failure did not come back")
    return failed
