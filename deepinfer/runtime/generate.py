"""A fully jitted generation loop for a static batch: prefill, then ``lax.while_loop`` on device.

This is the "fused on-device loop": no host round trip per token. Engine
benchmarks compare against it.

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
from deepinfer.kv.decode_state import (
    DEFAULT_MAX_BACKTRACK,
    StateLayout,
    init_decode_state,
)
from deepinfer.models.deepseek_v4.cached_model import extend
from deepinfer.runtime.sampler import sample


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 after the end
    num_generated: jax.Array  # [B] int32
    stopped_on_eos: jax.Array  # [B] bool


class SamplingArrays(NamedTuple):
    """Per-sequence sampling settings as device arrays [B]."""

    temperature: jax.Array  # <= 0: greedy
    top_k: jax.Array  # <= 0: off
    top_p: jax.Array  # >= 1: off
    seeds: jax.Array
    max_tokens: jax.Array  # per-sequence cap, <= max_new_tokens


def _generate(
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
    b = prompts.shape[0]
    state = init_decode_state(cfg, layout, dtype)
    logits, state = extend(cfg, params, state, prompts, prompt_lens, all_logits=False)

    def pick(logits, state):
        # the new token sits at position `lengths` (after everything committed so far)
        return sample(logits, state["lengths"], sp.seeds, sp.temperature, sp.top_k, sp.top_p)

    first = pick(logits, state)
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    hit_eos = jnp.isin(first, eos)
    done = hit_eos | (sp.max_tokens <= 1)
    count = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step, _, _, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, state, out, last, done, count, hit_eos = carry
        active = (~done).astype(jnp.int32)
        logits, state = extend(cfg, params, state, last[:, None], active, all_logits=False)
        tok = pick(logits, state)
        tok = jnp.where(done, -1, tok)
        out = out.at[:, step].set(tok)
        count = count + active
        new_eos = ~done & jnp.isin(tok, eos)
        hit_eos = hit_eos | new_eos
        done = done | new_eos | (count >= sp.max_tokens)
        return step + 1, state, out, jnp.where(tok >= 0, tok, last), done, count, hit_eos

    carry = (jnp.int32(1), state, out, first, done, count, hit_eos)
    _, _, out, _, _, count, hit_eos = jax.lax.while_loop(cond, body, carry)
    return GenerateOutput(out, count, hit_eos)


# One compiled program per static setup (config, layout, length, dtype).
_generate_jit = jax.jit(_generate, static_argnums=(0, 1, 2, 3))
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
    return _generate_jit(cfg, layout, max_new_tokens, dtype, params, jnp.asarray(arr), jnp.asarray(lens), sp, eos)
