"""Warm-up: every step program compiled before serving, and the step-cost model that
confidence-scheduled speculation plans with (seconds per step by token bucket, row bucket
and draft depth, timed on the device)."""

from __future__ import annotations

import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer.runtime.paged_step import paged_step_jit
from deepinfer.scheduler.plan import PlanShape, pack, pick_bucket, row_field_at
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
            for depth in range(1, engine.num_drafts + 1):
                costs[(shape.num_tokens, shape.num_rows, depth)] = time_step(engine, shape, depth)
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


def time_step(engine, shape: PlanShape, depth: int, repeats: int = 3) -> float:
    """Seconds one step of this shape takes on the device when the drafter drafts ``depth``
    (the fastest of a few). A padding-only plan runs the same program, so it costs what a full
    one does; one padding row is made to sample, so the drafter's loop runs depth - 1 times
    (its slot is out of range: every write it makes is dropped)."""
    ints, floats = pack(StepPlan(), engine.pools, shape, engine.layout.num_slots, {}, engine.cfg.vocab_size)
    ints[row_field_at(shape, "sample")] = 1
    ints[row_field_at(shape, "draft_depth")] = depth
    ints, floats = jnp.asarray(ints), jnp.asarray(floats)
    bitmask = engine._bitmask(StepPlan(), shape)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, engine.state = paged_step_jit(engine.family, engine.cfg, engine.layout, shape, engine.params,
                                           engine.state, ints, floats, bitmask)
        jax.block_until_ready(out.tokens)
        best = min(best, time.perf_counter() - t0)
    return best


def cost_model(engine, costs: dict) -> Callable[[int, int, int], float]:
    tokens, rows = engine.token_buckets, engine.row_buckets

    def cost(n_tokens: int, n_rows: int, depth: int) -> float:
        t = pick_bucket(max(min(n_tokens, tokens[-1]), 1), tokens)
        r = pick_bucket(max(min(n_rows, rows[-1], t), 1), rows)
        return costs.get((t, r, depth), max(costs.values()))

    log.info("speculation: step cost by token bucket (ms, most rows) at draft depth 1 / %d: %s", engine.num_drafts,
             {t: tuple(round(1e3 * max(v for (tt, _, d), v in costs.items() if tt == t and d == depth), 2)
                       for depth in (1, engine.num_drafts)) for t in tokens})
    return cost
