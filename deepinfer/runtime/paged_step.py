"""The engine's jitted step: a packed plan in, sampled tokens (and their logits) out, state updated.

One program per (token bucket, row bucket); the state is donated.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.kv.paged_state import PagedLayout
from deepinfer.models.deepseek_v4.model import lm_head, run_layers
from deepinfer.models.deepseek_v4.paged_attention import FlatBatch, paged_attention
from deepinfer.numerics import per_token
from deepinfer.runtime.sampler import (
    apply_logit_bias,
    apply_penalties,
    sample,
    token_logprobs,
)
from deepinfer.scheduler.plan import (
    FLOAT_FIELDS_R,
    INT_FIELDS_R,
    INT_FIELDS_T,
    PlanShape,
)
from deepinfer.scheduler.sampling_params import MAX_BIAS_SLOTS, MAX_LOGPROBS


def unpack(shape: PlanShape, pools: tuple[str, ...], ints: jax.Array, floats: jax.Array):
    """Inverse of engine.plan.pack (static offsets)."""
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
    return out, tables


# plan fields the per-row sampling reads
ROW_SAMPLING_FIELDS = ("slot", "length", "n_new", "sample", "seed", "top_k", "logprobs", "bias_ids", "bias_vals") + FLOAT_FIELDS_R


def update_token_stats(counts, in_prompt, f, fb: FlatBatch, tokens):
    """Per-slot output counts / prompt membership from this step's input tokens.

    Every output token enters the model as an input one step after it is sampled,
    so counting inputs (positions >= prompt_len are outputs) gives, at sampling
    time, exactly the outputs before the new one — with overlap placeholders
    already resolved, and rebuilt by the replay after a preemption. A row whose
    chunk starts at position 0 clears its slot first."""
    n_slots = counts.shape[0]
    fresh = jnp.where((f["length"] == 0) & (f["n_new"] > 0), f["slot"], n_slots)
    counts = counts.at[fresh].set(0, mode="drop")
    in_prompt = in_prompt.at[fresh].set(False, mode="drop")
    is_prompt = fb.positions < f["prompt_len"][fb.row]
    out_slot = jnp.where(fb.valid & ~is_prompt, fb.slot, n_slots)
    prompt_slot = jnp.where(fb.valid & is_prompt, fb.slot, n_slots)
    counts = counts.at[out_slot, tokens].add(1, mode="drop")
    in_prompt = in_prompt.at[prompt_slot, tokens].set(True, mode="drop")
    return counts, in_prompt


class StepOutput(NamedTuple):
    """What one step returns besides the new state (R: row bucket, T: token bucket, K: MAX_LOGPROBS).
    The logprob parts are zeros unless some row (token) asked for them."""

    tokens: jax.Array  # [R] int32: each row's sampled token (padding and mid-prompt rows: ignore)
    logits: jax.Array  # [R, V] fp32: raw logits at each row's last token
    logprobs: tuple  # (sampled [R] fp32, top ids [R, K] int32, top logprobs [R, K] fp32)
    prompt_logprobs: tuple  # the same three per token [T]: of the next prompt token


def paged_step(
    cfg: ModelConfig,
    layout: PagedLayout,
    shape: PlanShape,
    params: dict,
    state: dict,
    ints: jax.Array,
    floats: jax.Array,
) -> tuple[StepOutput, dict]:
    """Returns the step's outputs and the new state.

    Plan tokens of -1 are placeholders for a request's previous sampled token,
    read from ``state["last_token"][slot]``; this step's samples are written there.
    """
    pools = tuple(name for name, _ in layout.num_pages)
    f, tables = unpack(shape, pools, ints, floats)
    row = f["token_row"]
    fb = FlatBatch(
        positions=f["positions"],
        valid=f["valid"] > 0,
        row=row,
        slot=f["slot"][row],
        length=f["length"][row],
        start=f["start"][row],
        end=f["length"][row] + f["n_new"][row],
        tables={name: tables[name][row] for name in pools},
    )
    last_token = state["last_token"]
    tokens = jnp.where(f["tokens"] < 0, jnp.take(last_token, fb.slot, mode="clip"), f["tokens"])[None]

    def attention_for(i, layer_type, p):
        def fn(x):  # the flat batch is one row of T tokens
            y, new_st = paged_attention(cfg, p, layer_type, state["layers"][i], x[0], fb, layout.page_size)
            return y[None], {"state": new_st}

        return fn

    streams, layers_aux = run_layers(cfg, params, tokens, attention_for)
    last = jnp.clip(f["start"] + f["n_new"] - 1, 0, shape.num_tokens - 1)
    head = lambda h: lm_head(cfg, params, params["hc_head"], params["norm"], h)  # noqa: E731
    counts, in_prompt = update_token_stats(state["counts"], state["in_prompt"], f, fb, tokens[0])

    def sample_rows(h, r):
        """Head, logit processing and sampling for rows independently (r: their plan fields)."""
        logits = head(h)
        slot = jnp.minimum(r["slot"], counts.shape[0] - 1)  # padding rows read any slot; their samples are dropped
        processed = apply_logit_bias(logits, r["bias_ids"], r["bias_vals"])
        processed = apply_penalties(processed, counts, in_prompt, slot, r["repetition_penalty"],
                                    r["presence_penalty"], r["frequency_penalty"])
        sampled = sample(processed, r["length"] + r["n_new"], r["seed"], r["temperature"], r["top_k"], r["top_p"],
                         min_p=r["min_p"])
        logprobs = token_logprobs(logits, sampled, (r["logprobs"] > 0) & (r["sample"] > 0), MAX_LOGPROBS)
        return sampled, logits, logprobs

    tiled = cfg.batch_invariant  # rows and tokens in fixed tiles, as inside the model
    row_fields = {k: f[k] for k in ROW_SAMPLING_FIELDS}
    sampled, logits, logprobs = per_token(tiled, sample_rows, streams[0][last], row_fields)
    # prompt logprobs: the lm head at every token whose next prompt token is wanted (skipped otherwise)
    prompt_lp = per_token(
        tiled, lambda h, nxt: token_logprobs(h, nxt, nxt >= 0, MAX_LOGPROBS, head), streams[0], f["next_prompt_token"]
    )
    writes = jnp.where(f["sample"] > 0, f["slot"], last_token.shape[0])  # padding / mid-prompt rows: dropped
    new_state = {
        "layers": [aux["attn.state"] for aux in layers_aux],
        "last_token": last_token.at[writes].set(sampled, mode="drop"),
        "counts": counts,
        "in_prompt": in_prompt,
    }
    return StepOutput(sampled, logits, logprobs, prompt_lp), new_state


# One program per static (config, layout, plan shape); the state is updated in place.
paged_step_jit = jax.jit(paged_step, static_argnums=(0, 1, 2), donate_argnums=(4,))
