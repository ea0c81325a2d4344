"""The engine's jitted step: a packed plan in, sampled tokens (and their logits) out, state updated.

``run_step`` is the step on typed inputs; the engine reaches it through ``paged_step``
(a packed plan, one program per (token bucket, row bucket), the state donated), and
generate() / Decoder reach it with inputs built on the device (trivial_schedule.py).
The model part is the family's ``paged_forward``; the rest (placeholder tokens, penalty
statistics, the per-row head and sampling) is the runtime's own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.grammar.step_mask import bitmask_words
from deepinfer.kv.paged_state import EngineState, pin_state
from deepinfer.models.interface import FlatBatch, ModelFamily, PagedLayout
from deepinfer.numerics import per_token
from deepinfer.runtime.sampler import (
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
    token_logprobs,
    verify_sample,
)
from deepinfer.runtime.step_inputs import RowFields, TokenFields, flat_batch, unpack
from deepinfer.scheduler.plan import PlanShape
from deepinfer.scheduler.sampling_params import MAX_LOGPROBS


class Logprobs(NamedTuple):
    """Log-probabilities per row [R] (or per token [T] for prompt logprobs); K = MAX_LOGPROBS."""

    chosen: jax.Array  # [R] fp32: of the sampled (or next prompt) token
    top_ids: jax.Array  # [R, K] int32: the K most likely tokens
    top_logprobs: jax.Array  # [R, K] fp32


class StepOutput(NamedTuple):
    """What one step returns besides the new state (R: row bucket, T: token bucket, K1: 1 + the
    step's num_drafts). A row samples at its last K1 tokens' positions (those past its
    num_draft + 1 are ignored). The logprob parts are zeros unless some row (token) asked."""

    tokens: jax.Array  # [R, K1] int32: tokens sampled at the row's verified positions (ignore past num_emitted)
    num_emitted: jax.Array  # [R] int32: 1 + accepted drafts for sampling rows, 0 otherwise
    logits: jax.Array  # [R, K1, V] fp32: raw logits at those positions
    logprobs: Logprobs  # per row and position: [R, K1], [R, K1, K]
    prompt_logprobs: Logprobs  # per token: of the next prompt token
    drafts: jax.Array  # [R, num_drafts] int32: the drafter's tokens after the row's last emitted one
    draft_confidence: jax.Array  # [R, num_drafts] fp32: their probabilities under the drafter


def update_token_stats(counts, in_prompt, rows: RowFields, fb: FlatBatch, tokens):
    """Per-slot output counts / prompt membership from this step's input tokens.

    Every output token enters the model as an input one step after it is sampled,
    so counting inputs (positions >= prompt_len are outputs) gives, at sampling
    time, exactly the outputs before the new one — with overlap placeholders
    already resolved, and rebuilt by the replay after a preemption. A row whose
    chunk starts at position 0 clears its slot first."""
    n_slots = counts.shape[0]
    fresh = jnp.where((rows.length == 0) & (rows.n_new > 0), rows.slot, n_slots)
    counts = counts.at[fresh].set(0, mode="drop")
    in_prompt = in_prompt.at[fresh].set(False, mode="drop")
    is_prompt = fb.positions < rows.prompt_len[fb.row]
    out_slot = jnp.where(fb.valid & ~is_prompt, fb.slot, n_slots)
    prompt_slot = jnp.where(fb.valid & is_prompt, fb.slot, n_slots)
    counts = counts.at[out_slot, tokens].add(1, mode="drop")
    in_prompt = in_prompt.at[prompt_slot, tokens].set(True, mode="drop")
    return counts, in_prompt


def follow_in_flight(state: EngineState, tok: TokenFields, rows: RowFields) -> tuple[TokenFields, RowFields]:
    """Rows whose request's previous step was still in flight when the host planned this one
    (``follows``, speculation with overlap): the host counted all of that step's drafts as
    accepted, so the row's length and positions move by the slot's shift (accepted - verified,
    <= 0). Everything after this (the model, the sampler's positions, the drafter) sees true positions."""
    n_slots = state.shift.shape[0]
    shift = jnp.where(rows.follows > 0, jnp.take(state.shift, jnp.minimum(rows.slot, n_slots - 1)), 0)
    tok = tok._replace(positions=tok.positions + jnp.where(tok.valid > 0, shift[tok.token_row], 0))
    return tok, rows._replace(length=rows.length + shift)


def resolve_placeholders(state: EngineState, tokens: jax.Array, slot: jax.Array) -> jax.Array:
    """Plan tokens -1 -> the slot's last sampled token; -2 - j -> the slot's draft j (both from the
    previous step, on the device)."""
    last = jnp.take(state.last_token, slot, mode="clip")
    if state.drafts.shape[1]:
        j = jnp.clip(-2 - tokens, 0, state.drafts.shape[1] - 1)
        draft = state.drafts[jnp.clip(slot, 0, state.drafts.shape[0] - 1), j]
        last = jnp.where(tokens <= -2, draft, last)
    return jnp.where(tokens < 0, last, tokens)


class Forwarded(NamedTuple):
    """The model half of a step, handed to the sampling half (on the device)."""

    hidden: jax.Array  # [T, D]: the model's output streams at every token
    tokens: jax.Array  # [T] int32: the input tokens with placeholders resolved
    prompt_logprobs: Logprobs  # per token: of the next prompt token (zeros unless asked)


def forward_half(
    family: ModelFamily, cfg: ModelConfig, layout: PagedLayout, params: dict, state: EngineState,
    tok: TokenFields, rows: RowFields, tables: dict,
) -> tuple[Forwarded, EngineState]:
    """The part of a step that needs no grammar mask: the paged forward, the penalty statistics,
    prompt logprobs. ``sample_half`` finishes the step; ``run_step`` is the two in one program."""
    tok, rows = follow_in_flight(state, tok, rows)
    fb = flat_batch(tok, rows, tables)
    tokens = resolve_placeholders(state, tok.tokens, fb.slot)
    hidden, model_state = family.paged_forward(cfg, params, state.model, tokens, fb, layout.page_size)
    counts, in_prompt = update_token_stats(state.counts, state.in_prompt, rows, fb, tokens)
    # prompt logprobs: the lm head at every token whose next prompt token is wanted (skipped otherwise)
    head = lambda h: family.logits(cfg, params, h)  # noqa: E731
    prompt_lp = per_token(
        cfg.batch_invariant, lambda h, nxt: Logprobs(*token_logprobs(h, nxt, nxt >= 0, MAX_LOGPROBS, head)), hidden,
        tok.next_prompt_token,
    )
    return Forwarded(hidden, tokens, prompt_lp), state.replace(model=model_state, counts=counts, in_prompt=in_prompt)


def run_step(
    family: ModelFamily,
    cfg: ModelConfig,
    layout: PagedLayout,
    params: dict,
    state: EngineState,
    tok: TokenFields,
    rows: RowFields,
    tables: dict,
    num_drafts: int = 0,
    bitmask: jax.Array | None = None,
    varlen: bool = False,
) -> tuple[StepOutput, EngineState]:
    """One step on typed inputs -> (outputs, new state).

    Tokens of -1 are placeholders for a request's previous sampled token, read from
    ``state.last_token[slot]``; this step's last emitted tokens are written there.
    ``num_drafts`` > 0 (speculative decoding): a row's last ``num_draft`` tokens are drafts;
    the target samples at each of its last num_draft + 1 positions, accepts drafts while
    they pass verification (sampler.verify_sample: greedy rows while a draft equals the
    target's argmax, sampled rows by the rejection rule), and the family's drafter
    proposes ``num_drafts`` tokens after the last emitted one.
    ``bitmask`` [R, num_drafts + 1, ceil(V/32)] int32 (structured outputs): the tokens each
    (row, position) may sample, applied after logit bias and penalties and before every
    sampling filter; None or all ones: unconstrained.
    """
    fwd, state = forward_half(family, cfg, layout, params, state, tok, rows, tables)
    return sample_half(family, cfg, layout, params, state, fwd, tok, rows, tables, num_drafts, bitmask, varlen)


def sample_half(
    family: ModelFamily, cfg: ModelConfig, layout: PagedLayout, params: dict, state: EngineState, fwd: Forwarded,
    tok: TokenFields, rows: RowFields, tables: dict, num_drafts: int = 0, bitmask: jax.Array | None = None,
    varlen: bool = False,
) -> tuple[StepOutput, EngineState]:
    """The rest of a step after ``forward_half``: the head, logit processing, the mask, sampling
    and verification, the drafter, the per-slot last token. ``varlen``: rows verify any number of
    drafts up to num_drafts (confidence scheduling), so the sampling grid has every width."""
    tok, rows = follow_in_flight(state, tok, rows)
    fb = flat_batch(tok, rows, tables)
    hidden, tokens, model_state = fwd.hidden, fwd.tokens, state.model
    counts, in_prompt = state.counts, state.in_prompt
    num_tokens, width = tok.tokens.shape[0], num_drafts + 1
    last = jnp.clip(rows.start + rows.n_new - 1, 0, num_tokens - 1)
    head = lambda h: family.logits(cfg, params, h)  # noqa: E731

    def sample_rows(h, r: RowFields, draft, has_draft, allowed, later):
        """Head, logit processing, sampling (and verification of the draft there, if any) for
        (row, position) pairs independently."""
        logits = head(h)
        slot = jnp.minimum(r.slot, counts.shape[0] - 1)  # padding rows read any slot; their samples are dropped
        processed = apply_logit_bias(logits, r.bias_ids, r.bias_vals)
        processed = apply_penalties(processed, counts, in_prompt, slot, r.repetition_penalty,
                                    r.presence_penalty, r.frequency_penalty, later)
        processed = apply_token_bitmask(processed, allowed)
        sampled, accepted = verify_sample(processed, r.length + r.n_new, r.seed, r.temperature, r.top_k, r.top_p,
                                          r.min_p, draft, has_draft)
        logprobs = token_logprobs(logits, sampled, (r.logprobs > 0) & (r.sample > 0), MAX_LOGPROBS)
        return sampled, accepted, logits, Logprobs(*logprobs)

    # the (row, position) grid: position j of row r is flat token last - num_draft + j
    first = last - rows.num_draft
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    grid = jnp.clip(first[:, None] + j, 0, num_tokens - 1)  # [R, K1]
    tiled = cfg.batch_invariant  # rows and tokens in fixed tiles, as inside the model
    words = bitmask_words(cfg.vocab_size)
    if bitmask is None:
        bitmask = jnp.full((rows.slot.shape[0], width, words), -1, jnp.int32)

    def grid_of(w: int):
        """Sampling and verification at the first w positions of every row (enough when no row
        verifies more than w - 1 drafts), padded to the full width."""
        def run(_):
            j_w, grid_w = j[:, :w], grid[:, :w]
            # n_new as if the row ended at that position: the sampler's position is length + n_new
            at = rows._replace(n_new=rows.n_new - rows.num_draft)
            grid_rows = jax.tree.map(lambda a: jnp.repeat(a, w, axis=0), at)._replace(
                n_new=(at.n_new[:, None] + j_w).reshape(-1))
            # the draft verified at each (row, position): the row's next input token, for j < num_draft
            drafted = tokens[jnp.clip(grid_w + 1, 0, num_tokens - 1)]
            has_draft = j_w < rows.num_draft[:, None]
            # penalties at position j count the outputs before it: every input of the row is counted, so
            # the drafts after j (entered, not yet before j) are taken out again there
            i = jnp.arange(max(w - 1, 1), dtype=jnp.int32)[None, None, :]
            after_j = (i >= j_w[:, :, None]) & (i < rows.num_draft[:, None, None])
            later = jnp.where(after_j, drafted[:, None, : i.shape[-1]], cfg.vocab_size)  # [R, w, w - 1]; V: none
            out = per_token(tiled, sample_rows, hidden[grid_w.reshape(-1)], grid_rows, drafted.reshape(-1),
                            has_draft.reshape(-1), bitmask[:, :w].reshape(-1, words), later.reshape(-1, i.shape[-1]))
            pad = lambda a: jnp.pad(a.reshape(-1, w, *a.shape[1:]),  # noqa: E731
                                    [(0, 0), (0, width - w)] + [(0, 0)] * (a.ndim - 1))
            return jax.tree.map(pad, out)
        return run

    # the narrowest grid that holds every row's drafts: a step verifying few drafts (or none) pays
    # for what it verifies, not for the widest. The branches are widths 1, 2, 4, 8 below the widest
    # and the widest, not every width: each branch is a copy of the head and sampler, and a k = 5
    # varlen program compiled in 23 % less time with four than with six, while a step verifying 2
    # drafts in the 4-wide branch measured no slower than in a 3-wide one (BENCHMARKS.md §8)
    widths = tuple(sorted({w for w in (1, 2, 4, 8) if w < width} | {width})) if varlen else tuple(sorted({1, width}))
    if len(widths) == 1:
        sampled, ok, logits, logprobs = grid_of(width)(None)
    else:
        need = jnp.max(jnp.where(rows.sample > 0, rows.num_draft, 0)) + 1
        branch = jnp.sum(jnp.asarray(widths) < need)
        sampled, ok, logits, logprobs = jax.lax.switch(branch, [grid_of(w) for w in widths], None)
    # drafts are accepted while each passes verification; the first failure emits the target's token
    accepted = jnp.sum(jnp.cumprod(ok[:, :-1].astype(jnp.int32), axis=1), axis=1)
    samples = rows.sample > 0
    num_emitted = jnp.where(samples, accepted + 1, 0)
    final = jnp.take_along_axis(sampled, accepted[:, None], axis=1)[:, 0]
    # rejected drafts entered as inputs (counted as outputs): uncount them
    rejected = samples[:, None] & (j >= accepted[:, None] + 1) & (j <= rows.num_draft[:, None])
    uncount = jnp.where(rejected, jnp.minimum(rows.slot, counts.shape[0])[:, None], counts.shape[0])
    counts = counts.at[uncount, tokens[grid]].add(-1, mode="drop")
    drafts = jnp.zeros((rows.slot.shape[0], 0), jnp.int32)
    confidence = jnp.zeros((rows.slot.shape[0], 0), jnp.float32)
    if num_drafts:
        next_tokens = _next_tokens(tok, fb, tokens, grid, sampled, accepted, samples, rows.num_draft)
        drafts, confidence, model_state = family.draft_forward(
            cfg, params, model_state, hidden, next_tokens, fb, layout.page_size, first + accepted, samples, num_drafts,
            rows.draft_depth)
    writes = jnp.where(samples, rows.slot, state.last_token.shape[0])  # padding / mid-prompt rows: dropped
    new_state = state.replace(
        model=model_state,
        last_token=state.last_token.at[writes].set(final, mode="drop"),
        counts=counts,
        in_prompt=in_prompt,
        shift=state.shift.at[writes].set(accepted - rows.num_draft, mode="drop"),
    )
    if num_drafts:  # the next step may verify them before the host has read them (overlap)
        new_state = new_state.replace(drafts=state.drafts.at[writes, :num_drafts].set(drafts, mode="drop"))
    return StepOutput(sampled, num_emitted, logits, logprobs, fwd.prompt_logprobs, drafts, confidence), new_state


def _next_tokens(tok: TokenFields, fb: FlatBatch, tokens, grid, sampled, accepted, samples, num_draft) -> jax.Array:
    """[T] the token after each one, where known by the end of the step (-1 elsewhere): the next flat
    token of the same request; at a sampling row's verified positions the token emitted there (up
    to the accepted ones); at a chunk ending mid-prompt the host's next_token."""
    t = tokens.shape[0]
    idx = jnp.arange(t)
    nxt = jnp.where((idx + 1 < t) & (idx + 1 < fb.start + (fb.end - fb.length)), jnp.roll(tokens, -1), tok.next_token)
    nxt = jnp.where(fb.valid, nxt, -1)
    j = jnp.arange(grid.shape[1])[None, :]
    in_region = samples[:, None] & (j <= num_draft[:, None])
    emitted = jnp.where(j <= accepted[:, None], sampled, -1)
    return nxt.at[jnp.where(in_region, grid, t)].set(emitted, mode="drop")


def paged_step(
    family: ModelFamily,
    cfg: ModelConfig,
    layout: PagedLayout,
    shape: PlanShape,
    params: dict,
    state: EngineState,
    ints: jax.Array,
    floats: jax.Array,
    bitmask: jax.Array,
) -> tuple[StepOutput, EngineState]:
    """The engine's step: a plan packed by scheduler.plan.pack (and the grammar bitmask
    [R, num_drafts + 1, ceil(V/32)]) -> (outputs, new state)."""
    pools = tuple(name for name, _ in layout.num_pages)
    tok, rows, tables = unpack(shape, pools, ints, floats)
    out, state = run_step(family, cfg, layout, params, state, tok, rows, tables, shape.num_drafts, bitmask,
                          shape.varlen)
    return out, pin_state(family, cfg, layout, state)


def paged_forward_step(family, cfg, layout, shape: PlanShape, params, state, ints, floats):
    """The model half of the engine's step (structured outputs with overlap: the host fills the
    grammar mask while this runs, then dispatches ``paged_sample_step``)."""
    pools = tuple(name for name, _ in layout.num_pages)
    tok, rows, tables = unpack(shape, pools, ints, floats)
    fwd, state = forward_half(family, cfg, layout, params, state, tok, rows, tables)
    return fwd, pin_state(family, cfg, layout, state)


def paged_sample_step(family, cfg, layout, shape: PlanShape, params, state, fwd: Forwarded, ints, floats, bitmask):
    """The sampling half of the engine's step, after ``paged_forward_step``."""
    pools = tuple(name for name, _ in layout.num_pages)
    tok, rows, tables = unpack(shape, pools, ints, floats)
    out, state = sample_half(family, cfg, layout, params, state, fwd, tok, rows, tables, shape.num_drafts, bitmask,
                             shape.varlen)
    return out, pin_state(family, cfg, layout, state)


def paged_burst(family, cfg, layout, shape: PlanShape, params, state, ints, floats, bitmask):
    """``shape.steps`` decode steps of one packed plan in one program (a decode burst,
    scheduler/decode_burst.py): iteration i feeds each row the token it sampled in iteration i - 1
    (a placeholder: the slot's last token) at its position + i, so it computes what that many single
    steps would. -> (tokens [R, steps] int32, new state)."""
    pools = tuple(name for name, _ in layout.num_pages)
    tok, rows, tables = unpack(shape, pools, ints, floats)
    tokens, state = burst_steps(family, cfg, layout, params, state, tok, rows, tables, shape.steps, bitmask)
    return tokens, pin_state(family, cfg, layout, state)


def burst_steps(family, cfg, layout, params, state, tok: TokenFields, rows: RowFields, tables, steps: int, bitmask):
    """``steps`` decode steps of the same rows on typed inputs (the body of a burst, one device or one
    data-parallel rank) -> (tokens [R, steps], new state)."""
    def one(state, i):
        t = tok._replace(tokens=jnp.where(i > 0, -1, tok.tokens), positions=tok.positions + i)
        out, state = run_step(family, cfg, layout, params, state, t, rows._replace(length=rows.length + i), tables,
                              0, bitmask)
        return state, out.tokens[:, 0]

    state, tokens = jax.lax.scan(one, state, jnp.arange(steps, dtype=jnp.int32))
    return tokens.T, state


# One program per static (family, config, layout, plan shape); the state is updated in place.
paged_step_jit = jax.jit(paged_step, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
paged_forward_jit = jax.jit(paged_forward_step, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
paged_sample_jit = jax.jit(paged_sample_step, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
paged_burst_jit = jax.jit(paged_burst, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))


class StepPrograms(NamedTuple):
    """The programs an engine dispatches, all called as ``f(family, cfg, layout, shape, params, state,
    ...)``: these on one device or a mesh without data parallelism, runtime/data_parallel.py's with it."""

    step: object
    forward: object
    sample: object
    burst: object  # None: decode bursts not available


PROGRAMS = StepPrograms(paged_step_jit, paged_forward_jit, paged_sample_jit, paged_burst_jit)


def step_program(shape: PlanShape):
    """The jitted program that runs a plan of ``shape`` (a burst's, or the one-step program)."""
    return paged_burst_jit if shape.steps > 1 else paged_step_jit
