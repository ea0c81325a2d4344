"""One step program of an engine, compiled from abstract arguments: what the background warm-up
compiles ahead of time, and what the collective checks and the sharding notebook read (its HLO)."""

from __future__ import annotations

import jax.numpy as jnp

from deepinfer.runtime.ahead_of_time import abstract
from deepinfer.runtime.paged_step import paged_step_jit
from deepinfer.scheduler.plan import PlanShape, pack
from deepinfer.scheduler.step_plan import StepPlan


def abstract_inputs(engine, shape: PlanShape) -> tuple:
    """(ints, floats, bitmask) of an empty plan of ``shape``, as abstract arrays. Take them on the
    engine's thread (the all-ones bitmask is cached there)."""
    ints, floats = (jnp.asarray(a) for a in pack(StepPlan(), engine.pools, shape, engine.layout.num_slots, {},
                                                 engine.cfg.vocab_size))
    return abstract((ints, floats, engine._bitmask(StepPlan(), shape)))


def lower_step(engine, shape: PlanShape):
    """The step program for ``shape``, lowered (``.compile()`` it; ``.compile().as_text()`` is its HLO)."""
    return paged_step_jit.lower(engine.family, engine.cfg, engine.layout, shape, abstract(engine.params),
                                abstract(engine.state), *abstract_inputs(engine, shape))
