"""DeepSeek-V4's engine state: per-slot rings and paged pools of compressed rows, one entry per layer.

Everything is indexed by absolute token position, so the state never records a length:

* every layer — ``window``: ring of the last ``keep = sliding_window + max_backtrack``
  roped KV rows, [S, keep, hd]; position p lives in ring index p % keep.
* CSA / HCA — ``compressor``: ring of per-token compressor inputs (kv [S, P, W] in the
  model dtype, gate + positional bias [S, P, W] in fp32) for the window being filled
  (CSA's overlapping windows: and the one before), plus ``max_backtrack``:
  P = (2 if CSA else 1) * ratio + max_backtrack.
  ``rows``: a paged pool [pages, page_size, hd]; row w of a request is written when the
  token closing its window (position (w+1)*ratio - 1) is processed.
* CSA — ``indexer``: the same compressor ring and rows at ``index_head_dim``.

With ``layout.expert_load`` (EPLB), "expert_load": [layers, experts] int32 tokens routed to each
expert, a device-side counter (axis "count": neither per slot nor paged), added to by every step.

The tree is ``{"layers": [per layer], "mtp": [per MTP depth], "mtp_fed": ...}``; "mtp" (the
drafter's state: the same layer state for the MTP block's attention type) and "mtp_fed" (per
slot, the positions its window holds: a step may skip the drafter) only with ``layout.draft``.

All CSA layers share one block table ("csa"): main and indexer rows grow in lockstep
(one row per ratio tokens each), so one page id addresses both; HCA layers share "hca".

A ring entry or row written by a token that is later rolled back stays in memory but is
never read: visibility (window distance, ``w < (t+1) // ratio``) comes from positions,
and the token that re-commits the position rewrites it. That holds while a slot stays
within ``max_backtrack`` of the furthest position it processed (the rings keep that many
extra entries).
"""

from __future__ import annotations

import jax.numpy as jnp

from deepinfer.config import CSA, HCA, ModelConfig
from deepinfer.models.interface import PagedLayout, PoolInfo

POOL_OF_LAYER = {CSA: "csa", HCA: "hca"}


def window_keep(cfg: ModelConfig, max_backtrack: int) -> int:
    return cfg.sliding_window + max_backtrack


def compressor_keep(cfg: ModelConfig, layer_type: str, max_backtrack: int) -> int:
    """Token inputs a compressor must keep: the window being filled (CSA: and the one before)."""
    return (2 if layer_type == CSA else 1) * cfg.compress_ratio(layer_type) + max_backtrack


def _reach(cfg: ModelConfig, layer_type: str) -> int:
    """How far back a layer's per-slot state at a position reaches into its inputs: the window,
    or the compressor ring's open windows (CSA: and the one before)."""
    reach = cfg.sliding_window - 1
    if layer_type in (CSA, HCA):
        reach = max(reach, (2 if layer_type == CSA else 1) * cfg.compress_ratio(layer_type) - 1)
    return reach


def replay_horizon(cfg: ModelConfig, layout: PagedLayout) -> int:
    """Tokens whose replay from an empty slot state rebuilds every per-slot leaf exactly.

    Layer l's input at t depends on the tokens back to t - (l - 1)(W - 1) (each earlier layer
    attends over W - 1 tokens before; compressed rows come from the cache), and its state at
    position H needs inputs back to H - reach(l). The MTP block reads the last layer's
    streams and lags one token. Plus one: the state at H is that after token H - 1."""
    w = cfg.sliding_window - 1
    horizon = max(i * w + _reach(cfg, t) for i, t in enumerate(cfg.layer_types))
    if layout.draft:
        horizon = max(horizon, len(cfg.layer_types) * w + _reach(cfg, cfg.mtp_layer_types[0]) + 1)
    return horizon + 1


def pools(cfg: ModelConfig) -> tuple[PoolInfo, ...]:
    return tuple(PoolInfo(POOL_OF_LAYER[t], cfg.compress_ratio(t)) for t in (CSA, HCA) if t in cfg.layer_types)


def _layer(cfg: ModelConfig, layer_type: str, layout: PagedLayout, leaf) -> dict:
    """One layer's state tree, built by ``leaf(kind, shape_tail, dtype)`` (kind: "slot" or a pool name)."""
    st: dict = {"window": leaf("slot", (window_keep(cfg, layout.max_backtrack), cfg.head_dim), None)}

    def compressor(head_dim: int) -> dict:
        width = (2 if layer_type == CSA else 1) * head_dim
        keep = compressor_keep(cfg, layer_type, layout.max_backtrack)
        ring = {"kv": leaf("slot", (keep, width), None), "gate": leaf("slot", (keep, width), jnp.float32)}
        return {"compressor": ring, "rows": leaf(POOL_OF_LAYER[layer_type], (layout.page_size, head_dim), None)}

    if layer_type in (CSA, HCA):
        st.update(compressor(cfg.head_dim))
    if layer_type == CSA:
        st["indexer"] = compressor(cfg.index_head_dim)
    return st


def _tree(cfg: ModelConfig, layout: PagedLayout, leaf) -> dict:
    tree = {"layers": [_layer(cfg, t, layout, leaf) for t in cfg.layer_types]}
    if layout.draft:
        if not cfg.num_nextn_predict_layers:
            raise ValueError("speculative decoding needs an MTP block: the config has num_nextn_predict_layers = 0")
        tree["mtp"] = [_layer(cfg, cfg.mtp_layer_types[0], layout, leaf)]  # one MTP block, applied recursively
        # per slot: the drafter's window holds positions start .. next - 1 (a step may skip the drafter)
        tree["mtp_fed"] = {"start": leaf("slot", (), jnp.int32), "next": leaf("slot", (), jnp.int32)}
    if layout.expert_load:  # EPLB's counts: [layers, experts] tokens routed (MTP block not counted)
        tree["expert_load"] = leaf("count", (len(cfg.layer_types), cfg.n_routed_experts), jnp.int32)
    return tree


def init_state(cfg: ModelConfig, layout: PagedLayout, dtype) -> dict:
    """Zeros. dtype is the model's activation dtype (the gates stay fp32)."""

    def leaf(kind, tail, leaf_dtype):
        if kind == "count":
            return jnp.zeros(tail, leaf_dtype)
        lead = layout.num_slots if kind == "slot" else layout.pages(kind)
        return jnp.zeros((lead, *tail), leaf_dtype or dtype)

    return _tree(cfg, layout, leaf)


def state_axes(cfg: ModelConfig, layout: PagedLayout) -> dict:
    """Logical axis names per leaf: ("slot", None, "head_dim") or ("pages:<pool>", None, "head_dim")."""

    def leaf(kind, tail, _dtype):
        if kind == "count":
            return ("count",) + (None,) * (len(tail) - 1)
        lead = ("slot" if kind == "slot" else f"pages:{kind}",)
        return lead + ((None,) * (len(tail) - 1) + ("head_dim",) if tail else ())

    return _tree(cfg, layout, leaf)
