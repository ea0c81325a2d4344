"""Attention data-parallel, the device side: the step run per "dp" rank inside one shard_map.

The engine state's slots and pages are split over "dp" (rank r holds slots r * S .. r * S + S - 1
and the same share of every pool), and each rank's plan (scheduler/data_parallel.py) is packed on
its own with the rank's local ids, all ranks to one shape: the packed buffers are [dp, ...], one
row per rank. Inside the shard_map a rank unpacks its row and runs the ordinary step
(paged_step.run_step) on its local state, so attention, the rings, the pools and sampling never
leave the rank; only the MoE layers exchange tokens between ranks (models/deepseek_v4/moe.py).
The "tp" axis (and "cp") stay automatic inside, as on a mesh without DP.

Outputs come back per rank ([dp * R, ...] rows, [dp * T] tokens) and are put in the composite
plan's row (token) order by a gather with the order packed beside the plan, so what reads a
step's results (step_results.py) is the same as on one device. Not the logits [R, K1, V]: only
``keep_logits`` reads them, and gathering them every step would move the vocabulary-wide rows
between ranks; the host puts the kept ones in order (``StepPlan.output_rows``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from deepinfer.kv.paged_state import pin_state, state_shardings
from deepinfer.models.interface import PagedLayout
from deepinfer.runtime.paged_step import (
    Forwarded,
    StepOutput,
    StepPrograms,
    burst_steps,
    forward_half,
    run_step,
    sample_half,
)
from deepinfer.runtime.step_inputs import unpack
from deepinfer.scheduler.plan import Packer, PlanShape


class RankInputs(NamedTuple):
    """A data-parallel step's packed plan: each rank's buffers, and where the composite's rows
    (tokens) are in the ranks' outputs (rank * R + its index there; padding: 0)."""

    ints: np.ndarray | jax.Array  # [dp, int_size]
    floats: np.ndarray | jax.Array  # [dp, float_size]
    rows: np.ndarray | jax.Array  # [dp * R]
    tokens: np.ndarray | jax.Array  # [dp * T]


def num_ranks(cfg) -> int:
    plan = getattr(cfg, "sharding", None)
    return plan.data_parallel_size if plan is not None else 1


def rank_layout(layout: PagedLayout, ranks: int) -> PagedLayout:
    """One rank's share of the engine's layout (what its part of the step sees)."""
    return dataclasses.replace(layout, num_slots=layout.num_slots // ranks,
                               num_pages=tuple((name, n // ranks) for name, n in layout.num_pages))


def counts(plan) -> tuple[int, int]:
    """(tokens, rows) of the largest rank's part: what the step's shape must hold."""
    parts = plan.parts or [plan]
    return max(p.num_tokens for p in parts), max(len(p.scheduled) for p in parts)


def _in_rank_order(sizes: list[int], stride: int) -> np.ndarray:
    """[len(sizes) * stride]: item i of the composite (rank r's parts laid end to end, ``sizes[r]``
    each) sits at r * stride + its index in rank r; padding entries 0."""
    order = np.zeros(len(sizes) * stride, np.int32)
    i = 0
    for r, n in enumerate(sizes):
        order[i : i + n] = r * stride + np.arange(n)
        i += n
    return order


def row_order(plan, ranks: int, num_rows: int) -> np.ndarray:
    """[ranks * num_rows]: the composite plan's row i sits at rank * num_rows + j of the outputs."""
    parts = plan.parts or [type(plan)() for _ in range(ranks)]
    return _in_rank_order([len(p.scheduled) for p in parts], num_rows)


def pack(plan, packer: Packer, shape: PlanShape, ranks: int, seeds) -> RankInputs:
    parts = plan.parts or [type(plan)() for _ in range(ranks)]
    packed = [packer.pack(part, shape, seeds) for part in parts]
    tokens = _in_rank_order([p.num_tokens for p in parts], shape.num_tokens)
    plan.output_rows = row_order(plan, ranks, shape.num_rows)
    return RankInputs(np.stack([a for a, _ in packed]), np.stack([b for _, b in packed]), plan.output_rows, tokens)


def packer(engine) -> Packer:
    """The engine's plan packer: a rank's slots and pools (with data parallelism each rank packs its own
    rows with its local ids)."""
    return Packer(engine.pools, engine.config.max_num_seqs, engine.cfg.vocab_size, engine.cfg.eos_token_ids)


def packed_inputs(engine, plan, shape: PlanShape, seeds) -> tuple:
    """The engine's packed plan (numpy): (ints, floats), or with data parallelism (RankInputs, None)."""
    if engine.ranks == 1:
        return engine.packer.pack(plan, shape, seeds)
    return pack(plan, engine.packer, shape, engine.ranks, seeds), None


def bitmask_in_rank_order(mask: np.ndarray, plan, ranks: int, num_rows: int) -> np.ndarray:
    """A grammar bitmask filled in the composite's row order -> the ranks' [ranks * R, ...] rows (where
    ``pack`` put them: ``plan.output_rows``; the step is packed before its mask is filled)."""
    out = np.full((ranks * num_rows, *mask.shape[1:]), -1, mask.dtype)
    n = len(plan.scheduled)
    out[plan.output_rows[:n]] = mask[:n]
    return out


def _dp_only(spec: P) -> P:
    """A PartitionSpec with only its "dp" parts (what the shard_map makes manual; the rest stay
    automatic inside). "dp" leads every tuple it is in (the mesh is dp-major)."""
    def keep(entry):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return "dp" if "dp" in names else None

    return P(*(keep(e) for e in spec))


def param_specs(params) -> tuple:
    """The params' in-specs for the shard_map, flattened (a static argument of the programs)."""
    return tuple(_dp_only(a.sharding.spec) for a in jax.tree.leaves(params))


def _state_specs(family, cfg, layout):
    return jax.tree.map(lambda s: _dp_only(s.spec), state_shardings(family, cfg, layout))


def per_rank(fn, family, cfg, layout, specs, params, state, per_rank_args):
    """fn(local layout, params, state, *args with the rank's row) over "dp"; -> (outputs, state)."""
    ranks = num_ranks(cfg)
    local = rank_layout(layout, ranks)
    state_specs = _state_specs(family, cfg, layout)
    pspecs = jax.tree.unflatten(jax.tree.structure(params), specs)

    def body(params, state, *args):
        out, state = fn(local, params, state, *(jax.tree.map(lambda a: a[0], a) for a in args))
        return jax.tree.map(lambda a: a[None], out), state

    rank = P("dp")  # (a spec is a prefix: every leaf of an argument or of the outputs split by rank)
    out, state = jax.shard_map(body, mesh=cfg.sharding.mesh, in_specs=(pspecs, state_specs) + (rank,) * len(per_rank_args),
                               out_specs=(rank, state_specs), axis_names=frozenset({"dp"}),
                               check_vma=False)(params, state, *per_rank_args)
    return out, pin_state(family, cfg, layout, state)


def _flat(a):
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _in_plan_order(out: StepOutput, inputs: RankInputs) -> StepOutput:
    """[dp, R, ...] per rank -> the composite's rows (tokens) in order."""
    rows = lambda a: _flat(a)[inputs.rows]  # noqa: E731
    toks = lambda a: _flat(a)[inputs.tokens]  # noqa: E731
    per_row = {f: jax.tree.map(rows, getattr(out, f)) for f in out._fields if f not in ("prompt_logprobs", "logits")}
    return out._replace(**per_row, logits=_flat(out.logits), prompt_logprobs=jax.tree.map(toks, out.prompt_logprobs))


def _rank_bitmask(bitmask, ranks):
    return bitmask.reshape(ranks, -1, *bitmask.shape[1:])


def dp_step(family, cfg, layout, shape: PlanShape, specs, params, state, inputs: RankInputs, floats, bitmask):
    """The engine's step (paged_step) over the ranks. ``floats`` is unused (inside ``inputs``): the
    signature is paged_step's, so the engine calls either the same way."""
    pools = tuple(name for name, _ in layout.num_pages)

    def fn(local, params, state, ints, floats, mask):
        tok, rows, tables = unpack(shape, pools, ints, floats)
        return run_step(family, cfg, local, params, state, tok, rows, tables, shape.num_drafts, mask, shape.varlen)

    out, state = per_rank(fn, family, cfg, layout, specs, params, state,
                           (inputs.ints, inputs.floats, _rank_bitmask(bitmask, num_ranks(cfg))))
    return _in_plan_order(out, inputs), state


def dp_forward(family, cfg, layout, shape: PlanShape, specs, params, state, inputs: RankInputs, floats):
    """The model half (structured outputs with overlap); its Forwarded stays in rank order [dp, ...]."""
    pools = tuple(name for name, _ in layout.num_pages)

    def fn(local, params, state, ints, floats):
        tok, rows, tables = unpack(shape, pools, ints, floats)
        return forward_half(family, cfg, local, params, state, tok, rows, tables)

    return per_rank(fn, family, cfg, layout, specs, params, state, (inputs.ints, inputs.floats))


def dp_sample(family, cfg, layout, shape: PlanShape, specs, params, state, fwd: Forwarded, inputs: RankInputs, floats,
              bitmask):
    pools = tuple(name for name, _ in layout.num_pages)

    def fn(local, params, state, fwd, ints, floats, mask):
        tok, rows, tables = unpack(shape, pools, ints, floats)
        return sample_half(family, cfg, local, params, state, fwd, tok, rows, tables, shape.num_drafts, mask,
                           shape.varlen)

    out, state = per_rank(fn, family, cfg, layout, specs, params, state,
                           (fwd, inputs.ints, inputs.floats, _rank_bitmask(bitmask, num_ranks(cfg))))
    return _in_plan_order(out, inputs), state


def dp_burst(family, cfg, layout, shape: PlanShape, specs, params, state, inputs: RankInputs, floats, bitmask):
    """A decode burst (paged_step.paged_burst) over the ranks: every rank's rows run ``shape.steps``
    steps in one program (the experts' exchange in each). -> (tokens [rows in plan order, steps], state)."""
    pools = tuple(name for name, _ in layout.num_pages)

    def fn(local, params, state, ints, floats, mask):
        tok, rows, tables = unpack(shape, pools, ints, floats)
        return burst_steps(family, cfg, local, params, state, tok, rows, tables, shape.steps, mask)

    tokens, state = per_rank(fn, family, cfg, layout, specs, params, state,
                              (inputs.ints, inputs.floats, _rank_bitmask(bitmask, num_ranks(cfg))))
    return _flat(tokens)[inputs.rows], state


_dp_step_jit = jax.jit(dp_step, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))
_dp_burst_jit = jax.jit(dp_burst, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))
_dp_forward_jit = jax.jit(dp_forward, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))
_dp_sample_jit = jax.jit(dp_sample, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))


@dataclasses.dataclass(frozen=True)
class _WithSpecs:
    """A DP program with the params' in-specs bound: called (and lowered) as paged_step's are."""

    jitted: object
    specs: tuple

    def __call__(self, family, cfg, layout, shape, *args):
        return self.jitted(family, cfg, layout, shape, self.specs, *args)

    def lower(self, family, cfg, layout, shape, *args):
        return self.jitted.lower(family, cfg, layout, shape, self.specs, *args)


def programs(params) -> StepPrograms:
    """The engine's step programs under attention data-parallel."""
    specs = param_specs(params)
    return StepPrograms(_WithSpecs(_dp_step_jit, specs), _WithSpecs(_dp_forward_jit, specs),
                        _WithSpecs(_dp_sample_jit, specs), _WithSpecs(_dp_burst_jit, specs))
