"""Jitted prefill / decode_step / rollback over a decode state, for one model config.

The state is passed in and returned (donated: updated in place on device); the
Decoder holds only the config, the layout and the compiled functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import ModelConfig
from deepinfer.kv.decode_state import (
    StateLayout,
    check_rollback,
    init_decode_state,
    rollback,
)
from deepinfer.models.deepseek_v4.cached_model import extend

# Module-level jitted functions so every Decoder of the same config shares compiled programs.
_extend_jit = jax.jit(extend, static_argnums=(0,), static_argnames=("all_logits",), donate_argnums=(2,))
_rollback_jit = jax.jit(rollback, donate_argnums=(0,))
_init_jit = jax.jit(init_decode_state, static_argnums=(0, 1, 2))


class Decoder:
    """Incremental decoding for a static batch of sequences at possibly different lengths."""

    def __init__(self, cfg: ModelConfig, layout: StateLayout, dtype=jnp.float32):
        self.cfg, self.layout, self.dtype = cfg, layout, jnp.dtype(dtype)

    def _extend(self, params, state, tokens, n_valid, all_logits):
        return _extend_jit(self.cfg, params, state, tokens, n_valid, all_logits=all_logits)

    def init_state(self) -> dict:
        return _init_jit(self.cfg, self.layout, self.dtype)

    def prefill(
        self,
        params: dict,
        state: dict,
        tokens: np.ndarray,
        lengths: np.ndarray | None = None,
        chunk_size: int | None = None,
        all_logits: bool = True,
    ) -> tuple[jax.Array, dict]:
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
        outs, last = [], None
        for start in range(0, max(s, 1), chunk):
            piece = np.zeros((b, chunk), np.int32)
            width = min(chunk, s - start)
            piece[:, :width] = tokens[:, start : start + width]
            n_valid = np.clip(lengths - start, 0, chunk).astype(np.int32)
            logits, state = self._extend(params, state, jnp.asarray(piece), jnp.asarray(n_valid), all_logits=all_logits)
            if all_logits:
                outs.append(logits[:, :width])
            else:
                # keep, per sequence, the logits of the chunk holding its last real token
                has = jnp.asarray(n_valid > 0)[:, None]
                last = logits if last is None else jnp.where(has, logits, last)
        return (jnp.concatenate(outs, axis=1) if all_logits else last), state

    def decode_step(self, params: dict, state: dict, tokens: np.ndarray, active: np.ndarray | None = None):
        """One token per sequence: tokens [B] -> logits [B, V]. Inactive sequences are left unchanged."""
        tokens = jnp.asarray(tokens, jnp.int32).reshape(-1, 1)
        n = jnp.ones((tokens.shape[0],), jnp.int32) if active is None else jnp.asarray(active, jnp.int32)
        return self._extend(params, state, tokens, n, all_logits=False)

    def rollback(self, state: dict, k) -> dict:
        """Uncommit the last k[b] tokens of each sequence (k <= max_backtrack behind the furthest position)."""
        k = np.broadcast_to(np.asarray(k, np.int32), (self.layout.batch,))
        check_rollback(np.asarray(state["lengths"]), np.asarray(state["high_water"]), k, self.layout.max_backtrack)
        return _rollback_jit(state, jnp.asarray(k))
