"""Decode bursts: several decode steps of the same rows in one dispatch
(``EngineConfig.num_continuous_decode_steps``, SGLang's ``--num-continuous-decode-steps``).

A decode step costs the host a plan, a pack and a dispatch, and the device a program launch,
whatever it computes; on a small batch that overhead is most of the step (BENCHMARKS.md §1).
When every row of a step is a plain decode and nothing waits to be admitted, the rows can run
m steps on the device alone: iteration i feeds each row the token it sampled in iteration i - 1
(the per-slot placeholder the overlapped loop already uses) at the next position, so the tokens
are exactly those of m single steps (sampling depends only on seed and position; the penalty
counts follow the inputs). The host commits the m - 1 extra tokens at once, as scheduling m
steps in a row would (pages, ``num_computed``, one placeholder per token), and reads the m tokens
of each row together. A row that stops inside a burst (EOS, a stop token or string) has its later
tokens dropped, as a step run past a stop with overlap is: the device ran ahead, nothing else
changes (the window rings keep ``max_backtrack`` positions past a stop for its prefix snapshot,
so a burst is at most (max_backtrack + 1) // 2 steps, engine_config.py). Under attention
data-parallel the ranks' rows run in one program, so a step bursts when every rank's rows may,
each rank committing its own rows' pages. Host only.
"""

from __future__ import annotations


def burst_length(scheduler, plan, want: int) -> int:
    """``want`` when the plan's rows may run that many steps in one dispatch, else 1: every row a
    one-token decode that samples, with no drafts, grammar, logprobs or pending min_tokens, and room
    for want - 1 more tokens under max_tokens and max_model_len; no preemption or prefix-cache
    operation in the plan; nobody waiting who could be admitted (a burst would delay their first
    token); and pages for every row's extra tokens without preempting anyone."""
    if want <= 1 or not plan.scheduled or plan.preempted or plan.drafts or plan.cache:
        return 1
    if hasattr(scheduler, "ranks"):  # attention data-parallel: one program, so every rank's rows or none
        parts = scheduler.parts_of(plan)
        return want if all(burst_length(rank, part, want) == want for rank, part in zip(scheduler.ranks, parts)
                           if part.scheduled) else 1
    config = scheduler.config
    if scheduler.waiting and len(scheduler.running) < config.max_num_seqs:
        return 1
    extra = want - 1
    for req, n in plan.scheduled:
        rid, sp = req.request_id, req.sampling_params
        if n != 1 or rid not in plan.outputs or req.grammar is not None:
            return 1
        if sp.logprobs is not None or sp.prompt_logprobs is not None or sp.min_tokens > plan.outputs[rid]:
            return 1  # (a burst reports no logprobs; the EOS block of min_tokens is per step)
        if sp.max_tokens is not None and len(req.output_token_ids) + extra > sp.max_tokens:
            return 1
        if req.num_tokens + extra > config.max_model_len:
            return 1
    missing: dict[str, int] = {}
    for req, _ in plan.scheduled:
        for name, m in scheduler._pages_missing(req, extra).items():
            missing[name] = missing.get(name, 0) + max(m, 0)
    for name, m in missing.items():
        pool = scheduler.pools[name]
        if m > pool.num_free and scheduler.cache is not None:
            scheduler.cache.evict(name, m)  # cached pages nobody holds, as a step would
        if m > pool.num_free:
            return 1
    return want


def extend(scheduler, plan, steps: int) -> None:
    """Commit a burst of ``steps`` for the plan's rows (``burst_length`` said they fit): pages for
    the extra tokens, ``num_computed`` advanced, one placeholder output per extra token."""
    if hasattr(scheduler, "ranks"):  # each rank's rows on its own pools
        for rank, part in zip(scheduler.ranks, scheduler.parts_of(plan)):
            if part.scheduled:
                extend(rank, part, steps)
        plan.burst = steps
        return
    extra = steps - 1
    for req, _ in plan.scheduled:
        scheduler._grow(req, extra)
        req.num_computed += extra
        req.output_token_ids.extend([None] * extra)
    plan.burst = steps
