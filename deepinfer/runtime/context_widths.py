"""Block tables as wide as the step's contexts need (``EngineConfig.context_buckets``).

A step reads each row's compressed rows through a [rows, pages] block table per pool and masks
what lies past the row's context; the width is a static shape. With one width (max_model_len's)
every step pays for max_model_len whatever its rows hold: the CSA indexer scores, and attention
masks, every row of the table (bundled model, CPU: 16 decode rows of short context cost 5.7 ms
per step at max_model_len 1024 and 16.4 ms at 16384). So decode-sized shapes also get programs
whose tables are as wide as a smaller context needs, and a step runs in the narrowest one that
holds the pages its rows have.

Not in batch-invariant mode: a row's numbers must not depend on its neighbours, and the width,
chosen by the longest row, changes the reduction grouping over the (masked) table. Not for steps
with constrained rows under overlap (they run as two programs, warmed at the full width only).
During a background warm-up a narrow program is used once it is compiled (they compile last).
"""

from __future__ import annotations

import dataclasses

from deepinfer.scheduler.plan import PlanShape


def widths(engine) -> tuple[tuple[int, ...], ...]:
    """Per-pool table widths (pages), narrowest first; the full width (max_model_len's) last."""
    if engine.config.batch_invariant or engine.cfg.batch_invariant:
        return (engine.max_pages,)
    out = []
    for context in engine.config.context_bucket_sizes():
        w = tuple(max(1, min(full, -(-(context // p.ratio) // p.page_size))) for p, full in zip(engine.pools,
                                                                                               engine.max_pages))
        if w != engine.max_pages and w not in out:
            out.append(w)
    return (*out, engine.max_pages)


def narrow_shapes(engine, shapes: list[PlanShape]) -> list[PlanShape]:
    """The narrow variants of the decode-sized shapes among ``shapes`` (token buckets a decode step of
    max_num_seqs rows can fill, bursts included): compiled after every full-width program."""
    top = _decode_top(engine)
    return [dataclasses.replace(s, max_pages=w) for w in engine.context_widths[:-1] for s in shapes
            if s.num_tokens <= top]


def _decode_top(engine) -> int:
    """The token bucket a decode step of max_num_seqs rows (and their drafts) runs in."""
    decode = engine.config.max_num_seqs * (1 + engine.num_drafts)
    return min((t for t in engine.token_buckets if t >= decode), default=engine.token_buckets[-1])


def pages_needed(plan, pools) -> tuple[int, ...]:
    """The most pages any scheduled row holds, per pool (its table row must fit them all)."""
    return tuple(max((len(req.pages.get(p.name, ())) for req, _ in plan.scheduled), default=0) for p in pools)


def narrowed(engine, plan, shape: PlanShape) -> PlanShape:
    """``shape`` with the narrowest table width that holds the plan's rows and has a program (ready, if
    a background warm-up is still compiling); ``shape`` itself when none does."""
    if len(engine.context_widths) == 1 or shape.max_pages != engine.max_pages or shape.num_tokens > _decode_top(engine):
        return shape
    need = pages_needed(plan, engine.pools)
    for w in engine.context_widths[:-1]:
        if all(n <= m for n, m in zip(need, w)):
            narrow = dataclasses.replace(shape, max_pages=w)
            warming = engine.warming
            if warming is None or narrow in warming.ready_shapes:
                return narrow
    return shape
