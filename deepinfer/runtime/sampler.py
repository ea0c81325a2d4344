"""Per-sequence sampling on device: greedy, temperature, top-k, top-p, with a seed per sequence.

The noise is a pure function of (seed, absolute position, token id): Gumbel noise
over the vocabulary drawn from ``fold_in(key(seed), position)``. It never depends
on the batch slot, the step count or a shared key, so a sequence samples the same
tokens whatever else runs beside it. ``salt`` keeps independent streams apart
(e.g. draft vs target sampling in speculative decoding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.numerics import fixed_sum


def position_draws(seeds: jax.Array, positions: jax.Array, salt: int, draw) -> jax.Array:
    """draw(key) for each sequence's key fold_in(fold_in(key(seed), salt), position): every random
    number the sampler uses comes from here, a pure function of (seed, salt, position)."""

    def one(seed, pos):
        return draw(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), salt), pos))

    return jax.vmap(one)(seeds.astype(jnp.uint32), positions.astype(jnp.int32))


def sampling_noise(seeds: jax.Array, positions: jax.Array, vocab: int, salt: int = 0) -> jax.Array:
    """Gumbel noise [B, V] for each sequence's (seed, position)."""
    return position_draws(seeds, positions, salt, lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """logits [B, V] + bias at (row, ids[row, j]); ids >= V are unused slots (dropped)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.astype(jnp.float32).at[rows, ids].add(values, mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits [B, V] with the tokens a grammar forbids set to -inf. bitmask [B, ceil(V/32)] int32:
    bit (v % 32) of word v // 32 set = token v allowed (xgrammar's packing). A batch whose masks
    are all ones (no row constrained) skips the unpacking."""
    vocab = logits.shape[-1]

    def apply(_):
        bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
        allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab] > 0
        return jnp.where(allowed, logits, -jnp.inf)

    return jax.lax.cond(jnp.all(bitmask == -1), lambda _: logits, apply, None)


def apply_penalties(
    logits: jax.Array, counts: jax.Array, in_prompt: jax.Array, slots: jax.Array,
    repetition: jax.Array, presence: jax.Array, frequency: jax.Array, uncounted: jax.Array | None = None,
) -> jax.Array:
    """Repetition (tokens in prompt or output: positive logits divided, negative multiplied),
    then frequency * count and presence * (count > 0) subtracted (output tokens only).
    counts [S, V] int (output occurrences per slot), in_prompt [S, V] bool, slots [B]: each
    row's slot; uncounted [B, k] (ids >= V: none): tokens counted in the slot but not before this
    row's position (speculation: the drafts after it). Skipped, gathers included, when no row asks."""

    def apply(_):
        c = counts[slots]
        if uncounted is not None:
            c = c.at[jnp.arange(c.shape[0])[:, None], uncounted].add(-1, mode="drop")
        seen = (c > 0) | in_prompt[slots]
        rep = repetition[:, None]
        x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        c = c.astype(jnp.float32)
        return x - frequency[:, None] * c - presence[:, None] * (c > 0)

    wanted = jnp.any(repetition != 1.0) | jnp.any(presence != 0.0) | jnp.any(frequency != 0.0)
    return jax.lax.cond(wanted, apply, lambda _: logits, None)


def filter_logits(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None
) -> jax.Array:
    """Temperature-scaled logits [B, V] with everything outside min-p / top-k / top-p set to -inf.

    min_p <= 0, top_k <= 0 and top_p >= 1 switch those filters off. Ties at a threshold are kept.
    The filters sort the vocabulary (two sorts of [B, V]: ~70 ms for 8 x 32000 on
    XLA CPU), so they only run when some row asks for them.
    """
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
    if min_p is None:
        min_p = jnp.zeros_like(top_p)
    wanted = jnp.any(top_k > 0) | jnp.any(top_p < 1.0) | jnp.any(min_p > 0)
    return jax.lax.cond(wanted, _apply_filters, lambda s, k, p, m: s, scaled, top_k, top_p, min_p)


def _apply_filters(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    vocab = scaled.shape[-1]
    # min-p: drop tokens whose probability is below min_p times the most likely token's.
    probs = jax.nn.softmax(scaled, axis=-1)
    floor = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    scaled = jnp.where((min_p[:, None] > 0) & (probs < floor), -jnp.inf, scaled)
    desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    scaled = jnp.where((top_k[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)
    # top-p: the smallest set of most likely tokens whose mass reaches top_p.
    probs = jax.nn.softmax(scaled, axis=-1)
    sorted_p = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    kept = mass_before < top_p[:, None]
    min_kept = jnp.min(jnp.where(kept, sorted_p, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p[:, None] < 1.0) & (probs < min_kept), -jnp.inf, scaled)


def sample(
    logits: jax.Array,
    positions: jax.Array,
    seeds: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array | None = None,
) -> jax.Array:
    """Next tokens [B] from logits [B, V]; temperature <= 0 means greedy (argmax). The step's own
    sampler (verify_sample) with no drafts, so what is tested here is what the engine runs."""
    none = jnp.zeros(logits.shape[:1], jnp.int32)
    min_p = jnp.zeros_like(top_p) if min_p is None else min_p
    return verify_sample(logits, positions, seeds, temperature, top_k, top_p, min_p, none, none > 0)[0]


def token_logprobs(
    logits: jax.Array, sampled: jax.Array, wanted: jax.Array, k: int, logits_fn=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities (log-softmax of the raw logits [B, V]) of the sampled tokens [B]
    and the k most likely tokens per row: (sampled_lp [B], top_ids [B, k], top_lp [B, k]).

    Computed only when some row asks (``wanted`` [B] bool); zeros otherwise.
    ``logits_fn``: when given, ``logits`` is its input and the [B, V] logits are
    ``logits_fn(logits)``, computed only inside the taken branch (prompt logprobs
    need the lm head at every token, which is skipped when nobody asks).
    """
    b = logits.shape[0]
    vocab = jax.eval_shape(logits_fn, logits).shape[-1] if logits_fn is not None else logits.shape[-1]
    k = min(k, vocab)

    def compute(_):
        x = (logits_fn(logits) if logits_fn is not None else logits).astype(jnp.float32)
        shifted = x - jnp.max(x, axis=-1, keepdims=True)
        logp = shifted - jnp.log(fixed_sum(jnp.exp(shifted), axis=-1, keepdims=True))  # batch-independent bits
        top_lp, top_ids = jax.lax.top_k(logp, k)
        chosen = jnp.take_along_axis(logp, jnp.maximum(sampled, 0)[:, None], axis=-1)[:, 0]
        return chosen, top_ids.astype(jnp.int32), top_lp

    def skip(_):
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    return jax.lax.cond(jnp.any(wanted), compute, skip, None)


ACCEPT_SALT = 1  # the uniform draw that accepts or rejects a draft, apart from the sampling noise (salt 0)


def verify_sample(
    logits: jax.Array, positions: jax.Array, seeds: jax.Array, temperature: jax.Array, top_k: jax.Array,
    top_p: jax.Array, min_p: jax.Array, draft: jax.Array, has_draft: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Speculative verification at one position per row: (token [B], accepted [B] bool).

    The drafter proposes its argmax, a point mass q = one-hot(draft), so the standard rule
    (accept with min(1, p/q), else sample norm(max(0, p - q))) becomes: accept with
    probability p(draft); on rejection sample from p without the draft. The emitted token
    is then distributed exactly as p. Greedy rows accept when the draft is the argmax.
    Rows without a draft take the Gumbel-max sample of the filtered logits (``sample`` is this
    with no drafts).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        filtered = filter_logits(logits, temperature, top_k, top_p, min_p)
        probs = jax.nn.softmax(filtered, axis=-1)
        p_draft = jnp.take_along_axis(probs, jnp.maximum(draft, 0)[:, None], axis=-1)[:, 0]

        u = position_draws(seeds, positions, ACCEPT_SALT, lambda key: jax.random.uniform(key, (), jnp.float32))
        accept = has_draft & (u < p_draft)
        is_draft = has_draft[:, None] & (jnp.arange(logits.shape[-1])[None, :] == draft[:, None])
        rest = jnp.where(is_draft, -jnp.inf, filtered) + sampling_noise(seeds, positions, logits.shape[-1])
        token = jnp.where(accept, draft, jnp.argmax(rest, axis=-1).astype(jnp.int32))
        return (jnp.where(temperature <= 0, greedy, token),
                jnp.where(temperature <= 0, has_draft & (greedy == draft), accept))

    return jax.lax.cond(jnp.all(temperature <= 0), lambda _: (greedy, has_draft & (greedy == draft)), sampled, None)
