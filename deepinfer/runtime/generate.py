"""A fully jitted generation loop for a static batch: prefill, then ``lax.while_loop`` on device.

This is the "fused on-device loop": no host round trip per token. It runs the engine's
own state and step (runtime/paged_step.run_step) with an on-device trivial schedule
(sequence b is slot b, with fixed pages: trivial_schedule.py), so engine benchmarks
against it measure the host loop alone.

    out = deepinfer.generate(cfg, params, prompts, prompt_lens, max_new_tokens=32,
                             temperature=0.8, top_p=0.9, seeds=[1, 2])
    out.tokens          # [B, max_new_tokens] int32, -1 after a sequence finished
    out.num_generated   # [B]
    out.stopped_on_eos  # [B] bool
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import ModelConfig
from deepinfer.kv.paged_state import init_engine_state
from deepinfer.models.interface import ModelFamily
from deepinfer.models.registry import family_for
from deepinfer.runtime.paged_step import run_step
from deepinfer.runtime.platform import platform_in_use
from deepinfer.runtime.trivial_schedule import (
    DEFAULT_MAX_BACKTRACK,
    SamplingArrays,
    StateLayout,
    block_tables,
    chunk_inputs,
)

# Prefill runs in chunks of at most this many tokens across the batch (the step's
# attention is quadratic in its token count), each chunk one engine step.
PREFILL_TOKENS = 2048


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 after the end
    num_generated: jax.Array  # [B] int32
    stopped_on_eos: jax.Array  # [B] bool


def _generate(
    family: ModelFamily,
    cfg: ModelConfig,
    layout: StateLayout,
    max_new_tokens: int,
    dtype,
    params: dict,
    prompts: jax.Array,
    prompt_lens: jax.Array,
    sp: SamplingArrays,
    eos: jax.Array,
) -> GenerateOutput:
    b, s = prompts.shape
    paged = layout.paged(family, cfg)
    tables = block_tables(family, cfg, layout)
    state = init_engine_state(family, cfg, paged, dtype)

    def step(state, tokens, lengths, n_valid, sample):
        tok, rows = chunk_inputs(tokens, lengths, n_valid, prompt_lens, cfg.vocab_size, sp, sample)
        out, state = run_step(family, cfg, paged, params, state, tok, rows, tables)
        return out.tokens[:, 0], state

    # prefill: chunks of the prompts, each an engine step; a row samples its first token in the
    # chunk holding its last prompt token (at position prompt_len, as the engine does)
    chunk = s if b * s <= PREFILL_TOKENS else max(1, PREFILL_TOKENS // b)
    n_chunks = -(-s // chunk)
    padded = jnp.zeros((b, n_chunks * chunk), jnp.int32).at[:, :s].set(prompts)

    def prefill_chunk(i, carry):
        state, first = carry
        at = i * chunk
        n_valid = jnp.clip(prompt_lens - at, 0, chunk)
        ends = n_valid > 0
        ends = ends & (at + n_valid == prompt_lens)
        pieces = jax.lax.dynamic_slice_in_dim(padded, at, chunk, axis=1)
        tok, state = step(state, pieces, jnp.minimum(at, prompt_lens), n_valid, ends)
        return state, jnp.where(ends, tok, first)

    state, first = jax.lax.fori_loop(0, n_chunks, prefill_chunk, (state, jnp.zeros((b,), jnp.int32)))
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    hit_eos = jnp.isin(first, eos)
    done = hit_eos | (sp.max_tokens <= 1)
    count = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step_i, _, _, _, done, _, _ = carry
        return (step_i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step_i, state, out, last, done, count, hit_eos = carry
        active = ~done
        # the token fed now sits at position prompt_len + count - 1 (the count-th output)
        tok, state = step(state, last[:, None], prompt_lens + count - 1, active.astype(jnp.int32), active)
        tok = jnp.where(done, -1, tok)
        out = out.at[:, step_i].set(tok)
        count = count + active.astype(jnp.int32)
        new_eos = ~done & jnp.isin(tok, eos)
        hit_eos = hit_eos | new_eos
        done = done | new_eos | (count >= sp.max_tokens)
        return step_i + 1, state, out, jnp.where(tok >= 0, tok, last), done, count, hit_eos

    carry = (jnp.int32(1), state, out, first, done, count, hit_eos)
    _, _, out, _, _, count, hit_eos = jax.lax.while_loop(cond, body, carry)
    return GenerateOutput(out, count, hit_eos)


# One compiled program per static setup (family, config, layout, length, dtype).
_generate_jit = jax.jit(_generate, static_argnums=(0, 1, 2, 3, 4))
MAX_EOS_IDS = 8  # eos ids travel as a fixed-size array (-2 = unused) so new ids do not recompile


def _per_seq(value, b: int, dtype, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype)
    if arr.ndim == 0:
        return np.full((b,), arr, dtype)
    if arr.shape != (b,):
        raise ValueError(f"{name} must be a scalar or have one value per sequence ({b}), got shape {arr.shape}")
    return arr


def generate(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    prompt_lens: Sequence[int] | np.ndarray | None = None,
    *,
    max_new_tokens: int,
    max_tokens: Sequence[int] | int | None = None,
    temperature: Sequence[float] | float = 0.0,
    top_k: Sequence[int] | int = 0,
    top_p: Sequence[float] | float = 1.0,
    seeds: Sequence[int] | int = 0,
    eos_token_ids: Sequence[int] | None = None,
    max_len: int | None = None,
    max_backtrack: int = DEFAULT_MAX_BACKTRACK,
    family: ModelFamily | None = None,
) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens for each prompt, fully on device.

    prompts: a list of token lists (any lengths) or an int array [B, S] with
    ``prompt_lens``. Sampling settings are scalars or one per sequence;
    temperature 0 is greedy. ``eos_token_ids`` defaults to the config's (pass
    ``()`` to never stop early). ``max_len`` (prompt + generated) defaults to the
    longest prompt plus ``max_new_tokens``.
    """
    if isinstance(prompts, np.ndarray) or (len(prompts) and not isinstance(prompts[0], (list, tuple))):
        arr = np.asarray(prompts, np.int32)
        lens = np.full((arr.shape[0],), arr.shape[1], np.int32) if prompt_lens is None else np.asarray(prompt_lens, np.int32)
    else:
        lens = np.asarray([len(p) for p in prompts], np.int32)
        arr = np.zeros((len(prompts), max(1, int(lens.max()))), np.int32)
        for i, p in enumerate(prompts):
            arr[i, : len(p)] = p
    b = arr.shape[0]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if np.any(lens < 1):
        raise ValueError("every prompt needs at least one token")
    if np.any(arr < 0) or np.any(arr >= cfg.vocab_size):
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    needed = int(lens.max()) + max_new_tokens
    max_len = needed if max_len is None else max_len
    if max_len < needed:
        raise ValueError(f"max_len {max_len} is shorter than the longest prompt plus max_new_tokens ({needed})")
    sp = SamplingArrays(
        temperature=jnp.asarray(_per_seq(temperature, b, np.float32, "temperature")),
        top_k=jnp.asarray(_per_seq(top_k, b, np.int32, "top_k")),
        top_p=jnp.asarray(_per_seq(top_p, b, np.float32, "top_p")),
        seeds=jnp.asarray(_per_seq(seeds, b, np.uint32, "seeds")),
        max_tokens=jnp.asarray(_per_seq(max_new_tokens if max_tokens is None else max_tokens, b, np.int32, "max_tokens")),
    )
    if np.any(np.asarray(sp.max_tokens) < 1) or np.any(np.asarray(sp.max_tokens) > max_new_tokens):
        raise ValueError(f"max_tokens must lie in [1, max_new_tokens={max_new_tokens}]")
    eos_list = [int(e) for e in (cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)]
    if len(eos_list) > MAX_EOS_IDS:
        raise ValueError(f"at most {MAX_EOS_IDS} eos token ids are supported, got {len(eos_list)}")
    eos = jnp.asarray(eos_list + [-2] * (MAX_EOS_IDS - len(eos_list)), jnp.int32)
    layout = StateLayout(batch=b, max_len=max_len, max_backtrack=max_backtrack)
    dtype = jnp.dtype(params["embed"].dtype)
    family = family or family_for(cfg)
    if getattr(family, "compute_layout", None) is not None:  # as the engine's (pass engine.params to skip the work)
        params = family.compute_layout(params, platform_in_use())
    return _generate_jit(family, cfg, layout, max_new_tokens, dtype, params, jnp.asarray(arr), jnp.asarray(lens),
                         sp, eos)
