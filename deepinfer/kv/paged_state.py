"""The engine's device state: the model family's state plus what sampling keeps per slot.

The model part (``EngineState.model``) is whatever the family's ``init_state`` builds:
per-slot leaves and paged pools (models/interface.py). The rest is the runtime's own,
one entry per slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.models.interface import ModelFamily, PagedLayout
from deepinfer.scheduler.speculation import MAX_DRAFT_TOKENS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EngineState:
    """S: slots, V: vocabulary. Donated to every step (updated in place on the device)."""

    model: Any  # the family's state: per-slot leaves [S, ...] and pool leaves [pages, page_size, ...]
    # [S] int32: each slot's latest sampled token. A plan token of -1 is read from here on the
    # device, which lets the host plan a step before it knows the previous step's tokens
    # (one entry per slot, not a ring shared by steps, so a later step cannot overwrite it).
    last_token: jax.Array
    # [S, V] int32 / bool: how often each token occurs in the output so far, and which occur
    # in the prompt (penalties); rebuilt from the step inputs, so a preemption replay restores them.
    counts: jax.Array
    in_prompt: jax.Array
    # speculation with overlap: the host plans step N+1 before it knows how many drafts step N
    # accepted. [S, MAX_DRAFT_TOKENS] int32: each slot's latest drafts (plan tokens -2 - i read drafts[slot, i]);
    # [S] int32: accepted - verified drafts of the slot's latest step (a row flagged ``follows`` shifts
    # its positions by it: the host counted every draft as accepted).
    drafts: jax.Array
    shift: jax.Array

    def replace(self, **kw) -> "EngineState":
        return dataclasses.replace(self, **kw)


def init_engine_state(family: ModelFamily, cfg, layout: PagedLayout, dtype=jnp.float32) -> EngineState:
    """The zeroed state, built by one program: created leaf by leaf, each new shape of zeros compiled a
    program of its own (18 compiles, 0.7 s of the server's start on the bundled model)."""
    return _init_state_jit(family, cfg, layout, jnp.dtype(dtype))


def _init_state(family: ModelFamily, cfg, layout: PagedLayout, dtype) -> EngineState:
    return EngineState(
        model=family.init_state(cfg, layout, dtype),
        last_token=jnp.zeros((layout.num_slots,), jnp.int32),
        counts=jnp.zeros((layout.num_slots, cfg.vocab_size), jnp.int32),
        in_prompt=jnp.zeros((layout.num_slots, cfg.vocab_size), jnp.bool_),
        drafts=jnp.zeros((layout.num_slots, MAX_DRAFT_TOKENS if layout.draft else 0), jnp.int32),
        shift=jnp.zeros((layout.num_slots,), jnp.int32),
    )


def _init_state_placed(family: ModelFamily, cfg, layout: PagedLayout, dtype) -> EngineState:
    return pin_state(family, cfg, layout, _init_state(family, cfg, layout, dtype))


_init_state_jit = jax.jit(_init_state_placed, static_argnums=(0, 1, 2, 3))


def state_shardings(family: ModelFamily, cfg, layout: PagedLayout):
    """The EngineState's NamedShardings on ``cfg.sharding``'s mesh (None: one device). Every leaf is led
    by "slot" or "pages:<pool>" (the family's state_axes; the runtime's own leaves are per slot)."""
    plan = getattr(cfg, "sharding", None)  # a family's config without one runs on one device
    if plan is None:
        return None
    slot = lambda n: ("slot",) + (None,) * (n - 1)  # noqa: E731
    axes = EngineState(model=family.state_axes(cfg, layout), last_token=slot(1), counts=slot(2),
                       in_prompt=slot(2), drafts=slot(2), shift=slot(1))
    return plan.state_shardings(axes)


def pin_state(family: ModelFamily, cfg, layout: PagedLayout, state: EngineState) -> EngineState:
    """Inside a program: the state leaves with the shardings they came in with, so a step's output
    state is placed as its input was (left to the partitioner, a leaf could come back split
    differently: the next dispatch would then compile again and move it)."""
    shardings = state_shardings(family, cfg, layout)
    return state if shardings is None else jax.lax.with_sharding_constraint(state, shardings)


def _state_bytes(family: ModelFamily, cfg, layout: PagedLayout, dtype) -> int:
    shapes = jax.eval_shape(lambda: init_engine_state(family, cfg, layout, dtype))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def _one_page_each(layout: PagedLayout, bump: str | None = None) -> PagedLayout:
    pages = tuple((name, 2 if name == bump else 1) for name, _ in layout.num_pages)
    return dataclasses.replace(layout, num_pages=pages)


def bytes_per_page(family: ModelFamily, cfg, layout: PagedLayout, pool: str, dtype) -> int:
    """Device bytes one page of ``pool`` costs (all layers using it), measured on abstract states."""
    return _state_bytes(family, cfg, _one_page_each(layout, pool), dtype) - _state_bytes(
        family, cfg, _one_page_each(layout), dtype)


def bytes_per_slot(family: ModelFamily, cfg, layout: PagedLayout, dtype) -> int:
    """Device bytes of one slot's fixed state (everything but pool pages)."""
    one = dataclasses.replace(_one_page_each(layout), num_slots=1)
    two = dataclasses.replace(one, num_slots=2)
    return _state_bytes(family, cfg, two, dtype) - _state_bytes(family, cfg, one, dtype)
