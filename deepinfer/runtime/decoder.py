"""Decoder: incremental decoding of a static batch on the engine's state and paged forward.

Prefill (any chunk size), decode steps and checked rollback, for tests and notebooks that
want logits rather than sampled tokens. Sequence b is slot b with fixed pages
(trivial_schedule.py); each call is one family ``paged_forward`` over the flattened chunk,
the same function the engine's step runs. The state is donated (updated in place).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import ModelConfig
from deepinfer.kv.rollback import check_rollback
from deepinfer.models.interface import ModelFamily
from deepinfer.models.registry import family_for
from deepinfer.runtime.step_inputs import flat_batch
from deepinfer.runtime.trivial_schedule import StateLayout, block_tables, chunk_inputs

__all__ = ["Decoder", "DecodeState", "StateLayout"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeState:
    """B: the batch. ``model``: the family's engine state (slot b = sequence b)."""

    model: Any
    lengths: jax.Array  # [B] int32: committed tokens per sequence
    high_water: jax.Array  # [B] int32: the furthest position each sequence has processed (rollback bound)


def _extend(family: ModelFamily, cfg: ModelConfig, layout: StateLayout, all_logits: bool, params: dict,
            state: DecodeState, tokens: jax.Array, n_valid: jax.Array):
    """tokens [B, C], the first n_valid[b] real -> (logits [B, C, V] or [B, V] at each row's last real token, state)."""
    b, c = tokens.shape
    tok, rows = chunk_inputs(tokens, state.lengths, n_valid, state.lengths + n_valid, cfg.vocab_size)
    fb = flat_batch(tok, rows, block_tables(family, cfg, layout))
    hidden, model = family.paged_forward(cfg, params, state.model, tok.tokens, fb, layout.page_size)
    if all_logits:
        logits = family.logits(cfg, params, hidden).reshape(b, c, -1)
    else:
        last = rows.start + jnp.maximum(n_valid - 1, 0)
        logits = family.logits(cfg, params, hidden[last])
    ends = state.lengths + n_valid
    return logits, DecodeState(model, ends, jnp.maximum(state.high_water, ends))


# Module-level jitted functions so every Decoder of the same config shares compiled programs.
_extend_jit = jax.jit(_extend, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))


def _init(family, cfg, layout, dtype) -> DecodeState:
    zeros = jnp.zeros((layout.batch,), jnp.int32)
    return DecodeState(family.init_state(cfg, layout.paged(family, cfg), dtype), zeros, zeros)


_init_jit = jax.jit(_init, static_argnums=(0, 1, 2, 3))


class Decoder:
    """Incremental decoding for a static batch of sequences at possibly different lengths."""

    def __init__(self, cfg: ModelConfig, layout: StateLayout, dtype=jnp.float32, family: ModelFamily | None = None):
        self.cfg, self.layout, self.dtype = cfg, layout, jnp.dtype(dtype)
        self.family = family or family_for(cfg)

    def _extend(self, params, state, tokens, n_valid, all_logits):
        return _extend_jit(self.family, self.cfg, self.layout, all_logits, params, state, tokens, n_valid)

    def init_state(self) -> DecodeState:
        return _init_jit(self.family, self.cfg, self.layout, self.dtype)

    def prefill(
        self,
        params: dict,
        state: DecodeState,
        tokens: np.ndarray,
        lengths: np.ndarray | None = None,
        chunk_size: int | None = None,
        all_logits: bool = True,
    ) -> tuple[jax.Array, DecodeState]:
        """Append prompts tokens [B, S] (lengths[b] <= S real tokens each), in chunks of ``chunk_size``.

        Returns logits [B, S, V] for every position (``all_logits``) or [B, V] at
        each sequence's last real token, and the new state. One program is
        compiled per chunk size.
        """
        tokens = np.asarray(tokens)
        b, s = tokens.shape
        lengths = np.full((b,), s, np.int32) if lengths is None else np.asarray(lengths, np.int32)
        if np.any(lengths < 0) or np.any(lengths > s):
            raise ValueError(f"prompt lengths {lengths.tolist()} must lie in [0, {s}]")
        chunk = s if chunk_size is None else chunk_size
        if chunk <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self._check_room(np.asarray(state.lengths) + lengths)
        outs, last = [], None
        for start in range(0, max(s, 1), chunk):
            piece = np.zeros((b, chunk), np.int32)
            width = min(chunk, s - start)
            piece[:, :width] = tokens[:, start : start + width]
            n_valid = np.clip(lengths - start, 0, chunk).astype(np.int32)
            logits, state = self._extend(params, state, jnp.asarray(piece), jnp.asarray(n_valid), all_logits)
            if all_logits:
                outs.append(logits[:, :width])
            else:
                # keep, per sequence, the logits of the chunk holding its last real token
                has = jnp.asarray(n_valid > 0)[:, None]
                last = logits if last is None else jnp.where(has, logits, last)
        return (jnp.concatenate(outs, axis=1) if all_logits else last), state

    def decode_step(self, params: dict, state: DecodeState, tokens: np.ndarray, active: np.ndarray | None = None):
        """One token per sequence: tokens [B] -> logits [B, V]. Inactive sequences are left unchanged."""
        tokens = jnp.asarray(tokens, jnp.int32).reshape(-1, 1)
        n = jnp.ones((tokens.shape[0],), jnp.int32) if active is None else jnp.asarray(active, jnp.int32)
        return self._extend(params, state, tokens, n, False)

    def rollback(self, state: DecodeState, k) -> DecodeState:
        """Uncommit the last k[b] tokens of each sequence (k <= max_backtrack behind the furthest position)."""
        k = np.broadcast_to(np.asarray(k, np.int32), (self.layout.batch,))
        check_rollback(np.asarray(state.lengths), np.asarray(state.high_water), k, self.layout.max_backtrack)
        return dataclasses.replace(state, lengths=state.lengths - jnp.asarray(k))

    def _check_room(self, ends: np.ndarray) -> None:
        if np.any(ends > self.layout.max_len):
            raise ValueError(f"sequences would reach {int(ends.max())} tokens, past max_len={self.layout.max_len}")
