"""One step program of an engine, compiled from abstract arguments: what the background warm-up
compiles ahead of time, and what the collective checks and the sharding notebook read (its HLO)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.runtime.ahead_of_time import abstract
from deepinfer.runtime.data_parallel import packed_inputs
from deepinfer.scheduler.plan import PlanShape
from deepinfer.scheduler.step_plan import StepPlan


def abstract_inputs(engine, shape: PlanShape) -> tuple:
    """(ints, floats, bitmask) of an empty plan of ``shape``, as abstract arrays. Take them on the
    engine's thread (the all-ones bitmask is cached there)."""
    ints, floats = jax.tree.map(jnp.asarray, packed_inputs(engine, StepPlan(), shape, {}))
    return abstract((ints, floats, engine._bitmask(StepPlan(), shape)))


def lower_step(engine, shape: PlanShape):
    """The step program for ``shape``, lowered (``.compile()`` it; ``.compile().as_text()`` is its HLO)."""
    return engine.programs.step.lower(engine.family, engine.cfg, engine.layout, shape, abstract(engine.params),
                                abstract(engine.state), *abstract_inputs(engine, shape))
