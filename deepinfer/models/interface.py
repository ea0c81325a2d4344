"""What a model family gives the runtime. The runtime is handed a ``ModelFamily``; it never
imports a family's internals, so a second family (say a dense Llama-style one) lands in its
own package under ``models/`` and in ``registry.py``, and nothing under ``runtime/`` changes.

The engine state a family declares has two kinds of leaves:

* per-slot state, leading axis ``num_slots`` (fixed size per request, whatever its length:
  sliding-window rings, recurrent state);
* paged pools, leading axis ``pages`` of one named pool (growing with a request's length:
  a KV cache, compressed rows), addressed through per-request block tables;
* optionally device-side counters, leading logical axis ``count`` (e.g. tokens per expert for
  the expert load balancer): neither snapshotted nor paged.

A family also names its pools (``PoolInfo``: how many tokens make one pool row), so the
host scheduler can hand out pages without knowing the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FlatBatch:
    """The step's tokens as one flat batch, every array [T] (T: the token bucket).

    A token belongs to a request row; ``slot`` is that request's engine slot. ``tables``:
    pool name -> the token's request block table [T, max_pages] (page ids).
    """

    positions: jax.Array  # absolute position of each token in its request
    valid: jax.Array  # bool: False for padding tokens
    row: jax.Array  # the token's request row in the step
    slot: jax.Array  # the request's slot (state index)
    length: jax.Array  # the request's computed length before the step
    start: jax.Array  # flat index of the request's first token in the step
    end: jax.Array  # length + tokens of the request in the step
    tables: dict
    # Prefix caching (None: 0 for every token). A token at a position below ``write_from`` writes
    # no pool rows: its request shares those rows from the cache (the replay of a prefix hit).
    # Per-slot entries for positions below ``history_start`` do not exist (a replay that starts
    # from an empty slot state): reads must treat them as never filled.
    write_from: Optional[jax.Array] = None
    history_start: Optional[jax.Array] = None


@dataclass(frozen=True)
class PagedLayout:
    """Static sizes of an engine state (hashable: a static jit argument)."""

    num_slots: int
    page_size: int  # pool rows per page
    num_pages: tuple[tuple[str, int], ...]  # (pool name, pages) for the pools the model has
    max_backtrack: int = 12  # tokens a slot can be rolled back (speculation); sizes its rings
    draft: bool = False  # the state also holds the draft forward's per-slot state (speculative decoding)
    expert_load: bool = False  # the state also counts tokens per expert (EPLB): a leaf with axis "count"

    def pages(self, pool: str) -> int:
        return dict(self.num_pages)[pool]


@dataclass(frozen=True)
class PoolInfo:
    """A paged pool: one row per ``tokens_per_row`` tokens of a request."""

    name: str
    tokens_per_row: int


class ModelFamily(Protocol):
    """Pure functions of (config, params, ...); an implementation is a hashable value (it is a
    static jit argument), e.g. a frozen dataclass without fields.

    Shapes: T tokens in a flat step, H the family's per-token hidden value (whatever its
    ``logits`` reads, e.g. the final hidden state [D]), V the vocabulary.
    """

    def param_specs(self, cfg) -> dict:
        """The abstract parameter tree (deepinfer.params.ParamSpec leaves, with logical axes)."""

    def pools(self, cfg) -> tuple[PoolInfo, ...]:
        """The paged pools this config needs, in a fixed order (may be empty)."""

    def init_state(self, cfg, layout: PagedLayout, dtype) -> Any:
        """An empty model state: per-slot leaves [num_slots, ...], pool leaves [pages(pool), page_size, ...]."""

    def state_axes(self, cfg, layout: PagedLayout) -> Any:
        """Logical axis names of every state leaf (same tree as init_state): "slot" or "pages:<pool>" first."""

    def forward(self, cfg, params: dict, tokens: jax.Array) -> jax.Array:
        """Whole sequences [B, S] from position 0 -> logits [B, S, V] fp32 (reference, training)."""

    def paged_forward(self, cfg, params: dict, state: Any, tokens: jax.Array, batch: FlatBatch,
                      page_size: int) -> tuple[jax.Array, Any]:
        """One incremental step: tokens [T] at batch.positions -> (hidden [T, *H], new state).

        Writes what the step's valid tokens add (rings, pool rows) and reads each token's
        own request only. Nothing is committed per slot on the device: a slot's length is
        the host's ``batch.length``, so rolling back is the host lowering it (within
        ``layout.max_backtrack`` of the furthest position processed)."""

    def logits(self, cfg, params: dict, hidden: jax.Array) -> jax.Array:
        """hidden [..., *H] -> logits [..., V] fp32."""

    # Optional, for speculative decoding (a multi-token-prediction head), or None:
    #   draft_forward(cfg, params, state, hidden [T, *H], next_tokens [T], batch, page_size,
    #                 draft_from [R], draft_valid [R], num_drafts, depth [R] or None) -> (drafts [R, k]
    #                 int32, confidence [R, k] fp32, new state)
    # Feeds the drafter every valid token whose following token is known (next_tokens >= 0),
    # then drafts, for each valid row, the ``num_drafts`` tokens (only the first depth[r] of them:
    # the rest have confidence 0) that follow next_tokens[draft_from[r]] (the row's last emitted
    # token): greedy on the drafter; confidence: the drafted token's probability under it.
    # Needs an init_state built with layout.draft.
    draft_forward: Optional[Callable]

    # Optional, for families with Pallas kernel ops (pallas_kernels/):
    #   with_kernels(cfg, layout, max_pages, dtype, platform) -> cfg with the implementation of each op
    #   chosen for the platform in use (kernel or reference; logged). Without it the model runs as it is.

    # Optional: compute_layout(params, platform) -> the same weights stored as the platform's kernels
    # read them fastest (e.g. transposed on a CPU), applied once by the engine and generate() after
    # placement; the model's functions must accept both layouts. Without it params stay as loaded.
    # With it, checkpoint_layout(params) -> its inverse (the loaded tree: what placement reads).

    def check_draft(self, cfg, params: dict) -> None:
        """Raise ValueError naming what is missing when this config / these weights cannot draft."""

    def replay_horizon(self, cfg, layout: PagedLayout) -> Optional[int]:
        """Prefix caching without snapshots: how many tokens before a position determine the
        per-slot state there exactly (replaying that many from an empty slot state rebuilds it).
        0: the family has no per-slot state; None: unbounded (recurrent state), snapshots only."""
