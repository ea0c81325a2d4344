"""Warm-up: every step program compiled before serving, and the step-cost model that
confidence-scheduled speculation plans with (seconds per step by token bucket, row bucket
and draft depth, timed on the device)."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp

from deepinfer.runtime.paged_step import paged_step_jit
from deepinfer.scheduler.plan import PlanShape, pack, row_field_at
from deepinfer.scheduler.step_cost import StepCostModel
from deepinfer.scheduler.step_plan import StepPlan

log = logging.getLogger("deepinfer.runtime.engine")


def warm_up(engine, progress=None) -> int:
    """Compile the step for every bucket shape (``progress(1)`` after each), and with
    ``EngineConfig.warm_structured`` its two halves (constrained steps with overlap); with
    ``mtp_varlen``, time every shape at every draft depth for the step-cost model.
    Returns the number of step shapes."""
    costs = {}
    for shape in engine.bucket_shapes():
        engine._run(StepPlan(), shape)
        if engine.config.warm_structured and engine.grammar is not None and engine.overlap:
            # the two halves of a constrained step (otherwise compiled on first use)
            engine._run_sample(StepPlan(), shape, engine._run_forward(StepPlan(), shape))
        if engine.num_drafts and engine.config.mtp_varlen:  # the step-cost model of confidence scheduling
            key = (shape.num_tokens, shape.num_rows)
            if not shape.num_drafts:  # depth 0 verifying nothing runs the plain program (engine._shape_for)
                costs[key + ("depth", 0)] = time_step(engine, shape, 0)
            else:
                for depth in range(1, engine.num_drafts + 1):
                    costs[key + ("depth", depth)] = time_step(engine, shape, depth)
                for width in range(2, engine.num_drafts + 2):  # what a wider sampling grid adds
                    costs[key + ("width", width)] = max(0.0, time_step(engine, shape, 1, width)
                                                        - costs[key + ("depth", 1)])
        if progress is not None:
            progress(1)
    if costs:
        engine.scheduler.step_cost = cost_model(engine, costs)
    if engine.prefix is not None:
        engine.prefix.warmup()
    if engine.step_timer is not None:  # warm-up steps are not serving steps
        engine.step_timer.drain()
        engine.step_timer.reset()
    return len(engine.compiled_shapes)


def time_step(engine, shape: PlanShape, depth: int, width: int = 1, repeats: int = 3) -> float:
    """Seconds one step of this shape takes on the device when the drafter drafts ``depth`` (0:
    skipped) and the sampling grid is ``width`` positions wide. A padding-only plan runs the same
    program, so it costs what a full one does; one padding row is made to sample and verify
    width - 1 drafts, so the drafter's loop runs depth - 1 times and the grid's branch is that
    width's (its slot is out of range: every write is dropped). The steps are dispatched back to
    back and waited for once, as the overlapped loop runs them: a step timed alone would also
    count the wait for its result, which the loop hides, and so price every step too high."""
    ints, floats = pack(StepPlan(), engine.pools, shape, engine.layout.num_slots, {}, engine.cfg.vocab_size)
    ints[row_field_at(shape, "sample")] = 1
    ints[row_field_at(shape, "draft_depth")] = depth
    ints[row_field_at(shape, "num_draft")] = width - 1
    ints, floats = jnp.asarray(ints), jnp.asarray(floats)
    bitmask = engine._bitmask(StepPlan(), shape)

    def run():
        out, engine.state = paged_step_jit(engine.family, engine.cfg, engine.layout, shape, engine.params,
                                           engine.state, ints, floats, bitmask)
        return out

    jax.block_until_ready(run().tokens)  # its branches' first run out of the way
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = run()
    jax.block_until_ready(out.tokens)
    return (time.perf_counter() - t0) / repeats


def cost_model(engine, costs: dict) -> StepCostModel:
    """The step-cost model from the warm-up timings (refined by the loop's own, step_cost.py)."""
    model = StepCostModel(costs, engine.token_buckets, engine.row_buckets)
    log.info("speculation: step cost by token bucket (ms, most rows) at draft depth 0 / 1 / %d: %s", engine.num_drafts,
             {t: tuple(round(1e3 * max(v for (tt, _, kind, d), v in costs.items()
                                       if tt == t and kind == "depth" and d == depth), 2)
                       for depth in (0, 1, engine.num_drafts)) for t in engine.token_buckets})
    return model
