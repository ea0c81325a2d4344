"""The engine's side of decode bursts (``EngineConfig.num_continuous_decode_steps``; the host's
rules are scheduler/decode_burst.py): which shapes have burst programs, whether a planned step
runs as one, and its dispatch."""

from __future__ import annotations

import dataclasses

from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.scheduler import decode_burst
from deepinfer.scheduler.buckets import bucket_of, rows_for
from deepinfer.scheduler.plan import PlanShape


def enabled(engine) -> bool:
    """Bursts on: more than one step asked, and not while speculating (a step's accepted drafts
    decide the next) or keeping logits (a burst returns tokens only)."""
    return engine.config.num_continuous_decode_steps > 1 and not engine.num_drafts and not engine.config.keep_logits


def shapes(engine) -> list[PlanShape]:
    """The bursts' programs: each token bucket a decode step can run in (one token per row, up to
    max_num_seqs rows), at num_continuous_decode_steps steps; none when bursts are off."""
    if not enabled(engine):
        return []
    top = bucket_of(engine.config.max_num_seqs, engine.token_buckets)  # the bucket of a full decode step
    return [PlanShape(t, rows_for(t, engine.row_buckets), engine.max_pages, steps=engine.config.num_continuous_decode_steps)
            for t in engine.token_buckets if t <= top]


def shape_for(engine, plan, shape: PlanShape) -> PlanShape:
    """The shape to dispatch the plan as: a burst when its rows may run that many steps alone
    (committed here), else ``shape``. Not while a background warm-up compiles (burst programs come last)."""
    if not enabled(engine) or engine.warming is not None:
        return shape
    want = engine.config.num_continuous_decode_steps
    burst = dataclasses.replace(shape, steps=want)
    if burst not in shapes(engine) or decode_burst.burst_length(engine.scheduler, plan, want) != want:
        return shape
    decode_burst.extend(engine.scheduler, plan, want)
    engine.num_decode_bursts += 1
    return burst


def run(engine, shape: PlanShape, ints, floats, bitmask):
    """Dispatch a burst: only its tokens come back, [R, steps] (the rest of a step's outputs: None)."""
    with CompileCounter() as counter:
        tokens, engine.state = engine.programs.burst(engine.family, engine.cfg, engine.layout, shape, engine.params,
                                               engine.state, ints, floats, bitmask)
    engine.num_compiles += counter.count
    engine.compiled_shapes.add(shape)
    tokens.copy_to_host_async()
    if engine.step_timer is not None:
        engine.step_timer.dispatched(tokens, shape.steps)
    return tokens, None, None, None, None
