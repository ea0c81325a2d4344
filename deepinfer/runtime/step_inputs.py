"""The step's inputs as typed pytrees: per-token fields, per-row fields, block tables.

The engine packs a host plan into two buffers (scheduler/plan.py) and ``unpack`` turns them
back into these; generate() and Decoder build them on the device (trivial_schedule.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from deepinfer.models.interface import FlatBatch
from deepinfer.scheduler.plan import (
    FLOAT_FIELDS_R,
    INT_FIELDS_R,
    INT_FIELDS_T,
    PlanShape,
)
from deepinfer.scheduler.sampling_params import MAX_BIAS_SLOTS


class TokenFields(NamedTuple):
    """Every field [T] int32 (T: the token bucket)."""

    tokens: jax.Array  # -1: the request's previous sampled token (EngineState.last_token), -2 - j: its draft j
    positions: jax.Array
    token_row: jax.Array  # the token's request row
    valid: jax.Array  # 1: a real token, 0: padding
    next_prompt_token: jax.Array  # the prompt token after this one (prompt_logprobs), -1: none wanted
    next_token: jax.Array  # the token after this one if the host knows it and it is not in the step, else -1


class RowFields(NamedTuple):
    """Every field [R] (R: the row bucket) unless noted; one row per scheduled request."""

    slot: jax.Array  # int32; out of range for padding rows (their writes are dropped)
    length: jax.Array  # computed tokens before the step
    n_new: jax.Array  # tokens of the request in this step
    start: jax.Array  # flat index of its first token
    sample: jax.Array  # 1: the row's last token is the end of what is known (sample a token)
    seed: jax.Array
    top_k: jax.Array
    logprobs: jax.Array  # 1: report log-probabilities
    prompt_len: jax.Array
    num_draft: jax.Array  # the row's last num_draft tokens are drafts to verify (speculative decoding)
    write_from: jax.Array  # prefix hit: positions below write no pool rows (shared from the cache)
    history_start: jax.Array  # replay from an empty slot state: per-slot entries below do not exist
    follows: jax.Array  # 1: shift positions by EngineState.shift[slot] (speculation with overlap, plan.py)
    draft_depth: jax.Array  # drafts the drafter makes after the row's last emitted token (speculation)
    temperature: jax.Array  # float32 from here on
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    bias_ids: jax.Array  # [R, MAX_BIAS_SLOTS] int32 (vocab size: unused)
    bias_vals: jax.Array  # [R, MAX_BIAS_SLOTS] float32


def unpack(shape: PlanShape, pools: tuple[str, ...], ints: jax.Array, floats: jax.Array):
    """Inverse of scheduler.plan.pack (static offsets) -> (TokenFields, RowFields, tables {pool: [R, max_pages]})."""
    t, r = shape.num_tokens, shape.num_rows
    out, at = {}, 0
    for f in INT_FIELDS_T:
        out[f], at = ints[at : at + t], at + t
    for f in INT_FIELDS_R:
        out[f], at = ints[at : at + r], at + r
    tables = {}
    for name, m in zip(pools, shape.max_pages):
        tables[name], at = ints[at : at + r * m].reshape(r, m), at + r * m
    out["bias_ids"] = ints[at : at + r * MAX_BIAS_SLOTS].reshape(r, MAX_BIAS_SLOTS)
    for i, f in enumerate(FLOAT_FIELDS_R):
        out[f] = floats[i * r : (i + 1) * r]
    at = len(FLOAT_FIELDS_R) * r
    out["bias_vals"] = floats[at : at + r * MAX_BIAS_SLOTS].reshape(r, MAX_BIAS_SLOTS)
    tok = TokenFields(**{k: out[k] for k in TokenFields._fields})
    rows = RowFields(**{k: out[k] for k in RowFields._fields})
    return tok, rows, tables


def flat_batch(tok: TokenFields, rows: RowFields, tables: dict) -> FlatBatch:
    """Per-token views of the rows' fields (what the model's paged forward reads)."""
    row = tok.token_row
    return FlatBatch(
        positions=tok.positions,
        valid=tok.valid > 0,
        row=row,
        slot=rows.slot[row],
        length=rows.length[row],
        start=rows.start[row],
        end=rows.length[row] + rows.n_new[row],
        tables={name: table[row] for name, table in tables.items()},
        write_from=rows.write_from[row],
        history_start=rows.history_start[row],
    )
