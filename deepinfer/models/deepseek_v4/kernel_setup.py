"""V4's kernel choice: platform default, DEEPINFER_KERNELS override, then the start-up probe.

The family's ``with_kernels`` (models/interface.py): the engine hands it the platform and
layout, and the one decision (which implementation each op runs, and why) reads in one
place, with the log line that reports it.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from deepinfer.models.deepseek_v4.state import window_keep
from pallas_kernels.probe import ProbeExtents, probe_kernels
from pallas_kernels.selection import PALLAS_PLATFORMS, choose_kernels

log = logging.getLogger("deepinfer.kernels")


def probe_extents(cfg, layout, max_pages: int, dtype) -> ProbeExtents:
    return ProbeExtents(
        heads=cfg.num_attention_heads, head_dim=cfg.head_dim, window=cfg.sliding_window,
        ring=window_keep(cfg, layout.max_backtrack), page_size=layout.page_size, max_pages=max(max_pages, 1),
        index_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        hidden=cfg.hidden_size, expert_width=cfg.moe_intermediate_size, experts=cfg.n_routed_experts,
        dtype=str(dtype),
    )


def kernels_for(cfg, layout, max_pages, dtype, platform: str):
    """cfg with ``kernels`` set for ``platform``: each op's Pallas kernel or pure-JAX reference.

    On a platform Pallas lowers to, each chosen kernel is compiled once on the model's extents
    first; one that does not lower falls back to its reference, with a warning saying why.
    (Interpret mode on a CPU always lowers: nothing to probe.) ``max_pages``: the block tables'
    width, or every width the engine's programs use (runtime/context_widths.py): probed at each."""
    kernels = choose_kernels(platform, os.environ.get("DEEPINFER_KERNELS"))
    if cfg.batch_invariant and (kernels.uses("attention") or kernels.uses("indexer")):
        # The attention kernel reads a key from the ring or from the step depending on where the
        # step's chunk began, so its online softmax's order (and last bits) depends on the schedule;
        # the mode's guarantee is per position, so it runs the reference that gathers keys by
        # position. The indexer goes with it (the reference path scores inside the same tiles).
        # The MoE kernel is per row with fixed tiles: it stays.
        log.info("batch-invariant mode: attention and indexer run their references (bitwise per position)")
        kernels = dataclasses.replace(kernels, attention="ref", indexer="ref")
    if platform in PALLAS_PLATFORMS:
        for width in sorted(set(max_pages if isinstance(max_pages, tuple) else (max_pages,))):
            kernels, dropped = probe_kernels(kernels, probe_extents(cfg, layout, width, dtype))
            for op, why in dropped.items():
                log.warning("the %s kernel does not lower on %s at %d pages; running its reference instead (%s)",
                            op, platform, width, why)
    log.info("kernels on %s: %s", platform, kernels.describe())
    return cfg if kernels == cfg.kernels else cfg.replace(kernels=kernels)
