"""V4's drafter for speculative decoding: the MTP block over the engine state, fed every step.

The MTP block at position t reads the main model's pre-head streams at t and the embedding
of token t+1, and predicts token t+2 (mtp.py has the whole-sequence form). In the engine it
keeps its own per-slot state (the layer state of its attention type, ``state["mtp"][0]``)
and is fed each step, after the target, every token whose following token is known then:
inside the step the next flat token, at a row's end the token the target just emitted (or,
mid-prompt, the next prompt token from the host). Drafting k tokens after position q applies
the same block recursively, as vLLM and SGLang do for DeepSeek: the step at q + i reads the
block's own output streams at q + i - 1 and the draft token i.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer.config import SCORE_MOE, ModelConfig
from deepinfer.models.deepseek_v4.block import block
from deepinfer.models.deepseek_v4.model import embed, lm_head
from deepinfer.models.deepseek_v4.ops import linear, rms_norm
from deepinfer.models.deepseek_v4.paged_attention import paged_attention
from deepinfer.models.interface import FlatBatch
from deepinfer.numerics import per_token


def mtp_step(cfg: ModelConfig, params: dict, st: dict, streams: jax.Array, next_tokens: jax.Array, fb: FlatBatch,
             page_size: int):
    """The MTP block at every token of a flat batch: streams [T, hc, D], next_tokens [T] (token t+1) ->
    (output streams [T, hc, D], new MTP layer state). ``mtp_logits`` turns output streams into the
    logits for token t+2; the feeding needs them only where a row drafts, so they are not made per token."""
    p = params["mtp"][0]
    eps = cfg.rms_norm_eps

    def inputs(tok, h):
        e = rms_norm(embed(params, tok), p["enorm"], eps)
        return linear(e, p["e_proj"])[:, None, :] + linear(rms_norm(h, p["hnorm"], eps), p["h_proj"])

    x = per_token(cfg.batch_invariant, inputs, next_tokens, streams)
    layer_type = cfg.mtp_layer_types[0]

    def attn_fn(a):
        y, new_st = paged_attention(cfg, p["block"]["attn"], layer_type, st, a[0], fb, page_size)
        return y[None], {"state": new_st}

    out, aux = block(cfg, p["block"], SCORE_MOE, x[None], next_tokens[None], attn_fn)
    return out[0], aux["attn.state"]


def mtp_logits(cfg: ModelConfig, params: dict, streams: jax.Array) -> jax.Array:
    """The MTP block's head: output streams [B, hc, D] -> logits [B, V] fp32 (the shared lm head)."""
    p = params["mtp"][0]
    return per_token(cfg.batch_invariant, lambda o: lm_head(cfg, params, p["hc_head"], p["norm"], o), streams)


def _greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draft token (argmax) and its probability under the drafter, per row."""
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return token, jnp.take_along_axis(probs, token[:, None], axis=-1)[:, 0]


def draft_forward(cfg: ModelConfig, params: dict, state: dict, hidden: jax.Array, next_tokens: jax.Array,
                  fb: FlatBatch, page_size: int, draft_from: jax.Array, draft_valid: jax.Array, num_drafts: int,
                  depth: jax.Array | None = None):
    """Feed the drafter, then draft ``num_drafts`` tokens per valid row -> (drafts [R, k], confidence [R, k], state).

    Tokens whose next token is unknown (next_tokens < 0) are not fed (no state written). ``depth``
    [R] (default k): row r drafts only its first depth[r] tokens (the rest: confidence 0); the
    recursion runs max(depth) - 1 times, a loop on the device, so a step that wants few drafts
    (confidence-scheduled, at high load) does not pay for k. The first draft comes with the feeding.
    A step in which every row's depth is 0 skips the drafter altogether, feeding included (at high
    load confidence scheduling verifies nothing, and a step then costs what it costs without
    speculation); the slots' drafter windows then have a gap, which ``_fed_history`` hides."""
    n_rows = draft_from.shape[0]
    depth = jnp.full((n_rows,), num_drafts, jnp.int32) if depth is None else depth
    drafter = {"mtp": state["mtp"], "mtp_fed": state["mtp_fed"]}  # only the drafter's leaves go through the cond

    def skip(_):
        return jnp.zeros((n_rows, num_drafts), jnp.int32), jnp.zeros((n_rows, num_drafts), jnp.float32), drafter

    def run(_):
        return _feed_and_draft(cfg, params, drafter, hidden, next_tokens, fb, page_size, draft_from, draft_valid,
                               num_drafts, jnp.clip(depth, 1, num_drafts))

    drafts, confs, drafter = jax.lax.cond(_over_ranks(cfg, jnp.all(depth <= 0), jax.lax.pmin), skip, run, None)
    return drafts, confs, {**state, **drafter}


def _over_ranks(cfg: ModelConfig, value: jax.Array, combine) -> jax.Array:
    """A branch or loop bound that must agree across attention data-parallel ranks: the drafter's MoE
    exchanges tokens between them (a rank that skipped, or stopped looping, would leave the others
    waiting in that collective). ``combine``: lax.pmin / pmax over "dp". Elsewhere: ``value``."""
    plan = cfg.sharding
    if plan is None or not plan.in_data_parallel_step():
        return value
    return combine(value.astype(jnp.int32), "dp").astype(value.dtype)


def _fed_history(fed_state: dict, fb: FlatBatch, n_rows: int) -> tuple[jax.Array, dict]:
    """Where each fed token's drafter window starts -> (history_start [T], new fed state).

    ``fed_state``: per slot, ``start`` (the drafter's window holds every position from there to
    ``next`` - 1) and ``next`` (the position after the last one fed). A row fed from beyond its
    slot's ``next`` (the drafter skipped steps) starts a new history there: the window entries
    before it are stale and must read as never written, like a replay's (``history_start``)."""
    big = jnp.iinfo(jnp.int32).max
    first = jax.ops.segment_min(jnp.where(fb.valid, fb.positions, big), fb.row, num_segments=n_rows)
    last = jax.ops.segment_max(jnp.where(fb.valid, fb.positions, -1), fb.row, num_segments=n_rows)
    hist = jnp.zeros_like(fb.positions) if fb.history_start is None else fb.history_start
    row_hist = jax.ops.segment_max(jnp.where(fb.valid, hist, 0), fb.row, num_segments=n_rows)
    row_slot = jax.ops.segment_max(jnp.where(fb.valid, fb.slot, -1), fb.row, num_segments=n_rows)
    n_slots = fed_state["next"].shape[0]
    slot = jnp.clip(row_slot, 0, n_slots - 1)
    fresh = first <= row_hist  # the slot's state starts over here (a new request, a replay)
    gap = first > fed_state["next"][slot]
    start = jnp.where(fresh, row_hist, jnp.where(gap, first, fed_state["start"][slot]))
    writes = jnp.where((last >= 0) & (row_slot < n_slots), slot, n_slots)  # nothing fed (or padding): dropped
    new = {"start": fed_state["start"].at[writes].set(start, mode="drop"),
           "next": fed_state["next"].at[writes].set(last + 1, mode="drop")}
    return jnp.maximum(hist, start[jnp.clip(fb.row, 0, n_rows - 1)]), new


def _feed_and_draft(cfg, params, drafter, hidden, next_tokens, fb, page_size, draft_from, draft_valid, num_drafts, depth):
    """draft_forward's work when it runs; ``drafter``: the state's "mtp" and "mtp_fed" (returned updated)."""
    fed = dataclasses.replace(fb, valid=fb.valid & (next_tokens >= 0))
    n_rows = draft_from.shape[0]
    history, fed_state = _fed_history(drafter["mtp_fed"], fed, n_rows)
    fed = dataclasses.replace(fed, history_start=history)
    out, st = mtp_step(cfg, params, drafter["mtp"][0], hidden, jnp.maximum(next_tokens, 0), fed, page_size)
    idx = jnp.clip(draft_from, 0, hidden.shape[0] - 1)
    token, conf = _greedy(mtp_logits(cfg, params, out[idx]))
    drafts = jnp.zeros((n_rows, num_drafts), jnp.int32).at[:, 0].set(token)
    confs = jnp.zeros((n_rows, num_drafts), jnp.float32).at[:, 0].set(conf)
    q = fb.positions[idx]
    rows = jnp.arange(n_rows, dtype=jnp.int32)

    def one_more(i, carry):
        drafts, confs, streams, token, st = carry
        pos = q + i
        valid = draft_valid & (i < depth)
        one = FlatBatch(positions=pos, valid=valid, row=rows, slot=fb.slot[idx], length=pos, start=rows,
                        end=pos + 1, tables={k: t[idx] for k, t in fb.tables.items()}, history_start=history[idx])
        streams, st = mtp_step(cfg, params, st, streams, token, one, page_size)
        token, conf = _greedy(mtp_logits(cfg, params, streams))
        drafts = jax.lax.dynamic_update_slice(drafts, token[:, None], (0, i))
        confs = jax.lax.dynamic_update_slice(confs, jnp.where(valid, conf, 0.0)[:, None], (0, i))
        return drafts, confs, streams, token, st

    steps = _over_ranks(cfg, jnp.max(jnp.where(draft_valid, depth, 1)), jax.lax.pmax)
    drafts, confs, _, _, st = jax.lax.fori_loop(1, steps, one_more, (drafts, confs, out[idx], token, st))
    return drafts, confs, {"mtp": [st], "mtp_fed": fed_state}
