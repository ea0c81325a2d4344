"""Engine state on the device: per-request slots and paged pools of compressed rows.

* Slot state (fixed size per request, indexed by slot): the window ring
  ``window [S, keep, hd]`` of every layer, and for CSA / HCA layers the
  compressor token rings ``compressor {kv, gate} [S, P, W]`` (CSA: also the
  indexer's). Same layout as the contiguous decode state (decode_state.py),
  with slots in place of batch rows.
* Paged pools (growing with length, indexed by page): ``rows [pages, page_size, hd]``
  per CSA / HCA layer and ``indexer.rows [pages, page_size, index_head_dim]`` per
  CSA layer. All CSA layers share one block table ("csa"): main and indexer rows
  grow in lockstep (one row per ratio tokens each), so one page id addresses
  both; HCA layers share the "hca" table.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.config import CSA, HCA, ModelConfig
from deepinfer.kv.decode_state import layer_state

POOL_OF_LAYER = {CSA: "csa", HCA: "hca"}


@dataclass(frozen=True)
class PagedLayout:
    """Static sizes of the engine state (hashable: a static jit argument)."""

    num_slots: int
    page_size: int  # rows per page
    num_pages: tuple[tuple[str, int], ...]  # (pool name, pages) for the pools this model has
    max_backtrack: int = 12

    def pages(self, pool: str) -> int:
        return dict(self.num_pages)[pool]


def pools_of(cfg: ModelConfig) -> tuple[str, ...]:
    """The pools a model needs, in a fixed order."""
    return tuple(name for t, name in ((CSA, "csa"), (HCA, "hca")) if t in cfg.layer_types)


def init_paged_state(cfg: ModelConfig, layout: PagedLayout, dtype=jnp.float32) -> dict:
    """{"layers": per-layer slot rings and pools, "last_token": [slots] each slot's latest sampled token}.

    ``last_token`` is what lets the host plan a step before it knows the previous
    step's tokens: a plan token of -1 is read from here on the device. One entry
    per slot (not a ring shared by batches), so a later step cannot overwrite it.
    """
    def pool(layer_type: str):  # called only for CSA / HCA layers
        return lambda hd: jnp.zeros((layout.pages(POOL_OF_LAYER[layer_type]), layout.page_size, hd), dtype)

    layers = [layer_state(cfg, t, layout.num_slots, layout.max_backtrack, dtype, pool(t)) for t in cfg.layer_types]
    return {
        "layers": layers,
        "last_token": jnp.zeros((layout.num_slots,), jnp.int32),
        # per slot: how often each token occurs in the output so far, and which occur in the
        # prompt (penalties); rebuilt from the step inputs, so preemption replay restores them
        "counts": jnp.zeros((layout.num_slots, cfg.vocab_size), jnp.int32),
        "in_prompt": jnp.zeros((layout.num_slots, cfg.vocab_size), jnp.bool_),
    }


def bytes_per_page(cfg: ModelConfig, pool: str, page_size: int, dtype) -> int:
    """Device bytes one page of a pool costs across all layers using it."""
    item = jnp.dtype(dtype).itemsize
    layer_type = CSA if pool == "csa" else HCA
    per_row = cfg.head_dim + (cfg.index_head_dim if layer_type == CSA else 0)
    return sum(page_size * per_row * item for t in cfg.layer_types if t == layer_type)


def bytes_per_slot(cfg: ModelConfig, layout: PagedLayout, dtype) -> int:
    one = PagedLayout(1, layout.page_size, tuple((n, 1) for n, _ in layout.num_pages), layout.max_backtrack)
    shapes = jax.eval_shape(lambda: init_paged_state(cfg, one, dtype))
    total = sum(int(np.prod(shapes[k].shape)) * shapes[k].dtype.itemsize for k in ("last_token", "counts", "in_prompt"))
    for layer in shapes["layers"]:
        for path, leaf in jax.tree_util.tree_flatten_with_path(layer)[0]:
            if "rows" not in jax.tree_util.keystr(path):
                total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    return total
