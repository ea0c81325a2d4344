"""Per-sequence decode state for DeepSeek-V4, one entry per layer type.

Everything is indexed by absolute token position and derived from ``lengths``
(committed tokens per sequence), so rolling back k tokens is only ``lengths -= k``:

* every layer — ``window``: ring of the last ``keep = sliding_window + max_backtrack``
  roped KV rows, [B, keep, hd]; position p lives in slot p % keep.
* CSA / HCA — ``compressor``: ring of per-token compressor inputs (kv [B, P, W] in
  the model dtype, gate + positional bias [B, P, W] in fp32) for the tokens of the
  window being filled (and, for CSA's overlapping windows, the one before), plus
  ``max_backtrack``: P = (2 if CSA else 1) * ratio + max_backtrack.
  ``rows``: compressed rows [B, max_len // ratio, hd], row w written when the
  token closing its window (position (w+1)*ratio - 1) is processed.
* CSA — ``indexer``: the same compressor ring and rows at ``index_head_dim``.

A row or ring slot written by a token that is later rolled back stays in memory
but is never read: visibility (window distance, ``w < (t+1) // ratio``) is
computed from positions, and the token that re-commits the position rewrites it.
Rolling back is safe while a sequence stays within ``max_backtrack`` of the
furthest position it has processed (``high_water``); :func:`check_rollback`
enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import CSA, HCA, ModelConfig

DEFAULT_MAX_BACKTRACK = 12  # with V4's window of 128: keep = 140 rows


def window_keep(cfg: ModelConfig, max_backtrack: int) -> int:
    return cfg.sliding_window + max_backtrack


def compressor_keep(cfg: ModelConfig, layer_type: str, max_backtrack: int) -> int:
    """Token inputs a compressor must keep: the window being filled (CSA: and the one before)."""
    return (2 if layer_type == CSA else 1) * cfg.compress_ratio(layer_type) + max_backtrack


def layer_state(
    cfg: ModelConfig, layer_type: str, n: int, max_backtrack: int, dtype, rows: Callable[[int], jax.Array]
) -> dict:
    """One layer's state for n sequences (batch rows or engine slots).

    The window ring and compressor token rings are per sequence; ``rows(head_dim)``
    supplies the compressed-row storage (contiguous here, paged pools in the engine).
    """
    st: dict = {"window": jnp.zeros((n, window_keep(cfg, max_backtrack), cfg.head_dim), dtype)}

    def compressor(head_dim: int) -> dict:
        width = (2 if layer_type == CSA else 1) * head_dim
        keep = compressor_keep(cfg, layer_type, max_backtrack)
        ring = {"kv": jnp.zeros((n, keep, width), dtype), "gate": jnp.zeros((n, keep, width), jnp.float32)}
        return {"compressor": ring, "rows": rows(head_dim)}

    if layer_type in (CSA, HCA):
        st.update(compressor(cfg.head_dim))
    if layer_type == CSA:
        st["indexer"] = compressor(cfg.index_head_dim)
    return st


@dataclass(frozen=True)
class StateLayout:
    """Static sizes of a decode state (hashable: a static jit argument)."""

    batch: int
    max_len: int
    max_backtrack: int = DEFAULT_MAX_BACKTRACK

    def max_rows(self, cfg: ModelConfig, layer_type: str) -> int:
        return max(1, self.max_len // cfg.compress_ratio(layer_type))


def init_decode_state(cfg: ModelConfig, layout: StateLayout, dtype=jnp.float32) -> dict:
    """An empty state: no committed tokens. dtype is the model's activation dtype."""
    return {
        "lengths": jnp.zeros((layout.batch,), jnp.int32),
        "high_water": jnp.zeros((layout.batch,), jnp.int32),
        "layers": [
            layer_state(
                cfg, t, layout.batch, layout.max_backtrack, dtype,
                lambda hd, t=t: jnp.zeros((layout.batch, layout.max_rows(cfg, t), hd), dtype),
            )
            for t in cfg.layer_types
        ],
    }


def state_bytes(cfg: ModelConfig, layout: StateLayout, dtype=jnp.float32) -> int:
    """Device memory of a decode state, without allocating it."""
    shapes = jax.eval_shape(lambda: init_decode_state(cfg, layout, dtype))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def check_rollback(lengths: np.ndarray, high_water: np.ndarray, k: np.ndarray, max_backtrack: int) -> None:
    """Raise ValueError unless rolling back k[b] tokens of each sequence is safe (host-side check)."""
    k = np.asarray(k)
    if np.any(k < 0):
        raise ValueError(f"rollback counts must be >= 0, got {k.tolist()}")
    if np.any(k > lengths):
        raise ValueError(f"cannot roll back {k.tolist()} tokens from sequences of lengths {lengths.tolist()}")
    too_far = (high_water - (lengths - k)) > max_backtrack
    if np.any(too_far):
        b = int(np.argmax(too_far))
        raise ValueError(
            f"sequence {b}: rolling back to length {int(lengths[b] - k[b])} would go "
            f"{int(high_water[b] - lengths[b] + k[b])} tokens behind the furthest processed position "
            f"({int(high_water[b])}); at most max_backtrack={max_backtrack} rows are kept"
        )


def rollback(state: dict, k: jax.Array) -> dict:
    """Uncommit the last k[b] tokens of each sequence (validate with check_rollback first)."""
    return {**state, "lengths": state["lengths"] - k.astype(jnp.int32)}
