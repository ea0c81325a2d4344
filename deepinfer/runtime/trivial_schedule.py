"""The on-device schedule of a static batch: sequence b is slot b and owns fixed pages.

generate() and Decoder run the engine's own state and step (one incremental path); this
module builds the step's inputs for them without a host scheduler. Each step is a chunk
of C tokens per sequence, flattened to T = B * C tokens (token i of sequence b at flat
index b * C + i), one request row per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer.models.interface import ModelFamily, PagedLayout
from deepinfer.runtime.step_inputs import RowFields, TokenFields
from deepinfer.scheduler.sampling_params import MAX_BIAS_SLOTS

DEFAULT_MAX_BACKTRACK = 12  # with V4's window of 128: rings of 140 entries
PAGE_SIZE = 16  # pool rows per page, as the engine's default


@dataclass(frozen=True)
class StateLayout:
    """Static sizes of a static batch's state (hashable: a static jit argument)."""

    batch: int
    max_len: int  # tokens per sequence, prompt included
    max_backtrack: int = DEFAULT_MAX_BACKTRACK
    page_size: int = PAGE_SIZE

    def pages_per_sequence(self, tokens_per_row: int) -> int:
        return max(1, -(-(self.max_len // tokens_per_row) // self.page_size))

    def paged(self, family: ModelFamily, cfg) -> PagedLayout:
        """The engine layout holding this batch: one slot and a fixed run of pages per sequence."""
        pages = tuple((p.name, self.batch * self.pages_per_sequence(p.tokens_per_row)) for p in family.pools(cfg))
        return PagedLayout(self.batch, self.page_size, pages, self.max_backtrack)


def block_tables(family: ModelFamily, cfg, layout: StateLayout) -> dict:
    """pool -> [B, pages per sequence]: sequence b owns pages b * m .. b * m + m - 1."""
    out = {}
    for p in family.pools(cfg):
        m = layout.pages_per_sequence(p.tokens_per_row)
        out[p.name] = jnp.arange(layout.batch * m, dtype=jnp.int32).reshape(layout.batch, m)
    return out


class SamplingArrays(NamedTuple):
    """Per-sequence sampling settings as device arrays [B]."""

    temperature: jax.Array  # <= 0: greedy
    top_k: jax.Array  # <= 0: off
    top_p: jax.Array  # >= 1: off
    seeds: jax.Array
    max_tokens: jax.Array  # per-sequence cap, <= max_new_tokens


def chunk_inputs(
    tokens: jax.Array, lengths: jax.Array, n_valid: jax.Array, prompt_lens: jax.Array, vocab_size: int,
    sp: SamplingArrays | None = None, sample: jax.Array | None = None,
) -> tuple[TokenFields, RowFields]:
    """Step inputs for tokens [B, C] at lengths [B], the first n_valid[b] of each row real.

    ``sample`` [B] bool: rows whose last token should be sampled (default: none); ``sp``:
    their settings (default greedy). No penalties, bias or logprobs: what generate() offers."""
    b, c = tokens.shape
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    idx = jnp.arange(c, dtype=jnp.int32)[None, :]
    tok = TokenFields(
        tokens=i32(tokens).reshape(-1),
        positions=(lengths[:, None] + idx).reshape(-1),
        token_row=jnp.repeat(jnp.arange(b, dtype=jnp.int32), c),
        valid=i32(idx < n_valid[:, None]).reshape(-1),
        next_prompt_token=jnp.full((b * c,), -1, jnp.int32),
        next_token=jnp.full((b * c,), -1, jnp.int32),
    )
    zeros_f, zeros_i = jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32)
    rows = RowFields(
        slot=jnp.arange(b, dtype=jnp.int32),
        length=i32(lengths),
        n_new=i32(n_valid),
        start=jnp.arange(b, dtype=jnp.int32) * c,
        sample=zeros_i if sample is None else i32(sample),
        seed=zeros_i if sp is None else jax.lax.bitcast_convert_type(sp.seeds.astype(jnp.uint32), jnp.int32),
        top_k=zeros_i if sp is None else i32(sp.top_k),
        logprobs=zeros_i,
        prompt_len=i32(prompt_lens),
        num_draft=zeros_i,
        write_from=zeros_i,
        history_start=zeros_i,
        follows=zeros_i,
        draft_depth=zeros_i,
        temperature=zeros_f if sp is None else sp.temperature.astype(jnp.float32),
        top_p=zeros_f + 1.0 if sp is None else sp.top_p.astype(jnp.float32),
        min_p=zeros_f,
        repetition_penalty=zeros_f + 1.0,
        presence_penalty=zeros_f,
        frequency_penalty=zeros_f,
        bias_ids=jnp.full((b, MAX_BIAS_SLOTS), vocab_size, jnp.int32),  # out of range: unused
        bias_vals=jnp.zeros((b, MAX_BIAS_SLOTS), jnp.float32),
    )
    return tok, rows
