"""Reading a dispatched step's results into the requests: tokens (and accepted drafts), kept
logits, logprobs, prompt logprobs, the grammar matchers; then the scheduler's update."""

from __future__ import annotations

import time

import jax
import numpy as np

from deepinfer.scheduler.request import Request
from deepinfer.scheduler.scheduler import StepPlan


def read_step(engine, plan: StepPlan, tokens: jax.Array, logits: jax.Array, logprobs, prompt_logprobs,
          drafts) -> list[Request]:
    """Read a step's tokens (waits for that step only) and record them. ``logprobs`` /
    ``prompt_logprobs``: the device arrays, or None when no request in the step asked;
    ``drafts``: (emitted counts, drafts, confidence) when speculating."""
    t0 = time.perf_counter()
    tokens = np.asarray(tokens)
    engine.last_wait_s = time.perf_counter() - t0
    kept = np.asarray(logits) if engine.config.keep_logits else None
    if kept is not None and plan.output_rows is not None:  # data parallelism: logits in rank order
        kept = kept[plan.output_rows]
    lp = tuple(np.asarray(a) for a in logprobs) if logprobs is not None else None
    emitted, new_drafts, confidence = (np.asarray(a) for a in drafts) if drafts is not None else (None,) * 3
    engine.scheduler.locate_outputs(plan)  # an earlier step's rejected drafts moved them
    sampled = {}
    for i, (req, _) in enumerate(plan.scheduled):
        if plan.samples(req) and not req.is_finished:
            n = int(emitted[i]) if emitted is not None else plan.burst  # (a decode burst: [R, steps])
            sampled[req.request_id] = tokens[i, :n].tolist()
            engine.updated.append(req)
            if new_drafts is not None:
                depth = plan.draft_depth.get(req.request_id, new_drafts.shape[1])
                req.drafts, req.draft_confidence = new_drafts[i, :depth].tolist(), confidence[i, :depth].tolist()
            elif engine.num_drafts:  # the drafter was skipped: no drafts for the next step
                req.drafts, req.draft_confidence = [], []
            if kept is not None:
                req.logits.extend(kept[i, :n])
            k = req.sampling_params.logprobs
            if k is not None:
                for j in range(n):
                    req.token_logprobs[plan.outputs[req.request_id] + j] = (
                        float(lp[0][i, j]), lp[1][i, j, :k].tolist(), lp[2][i, j, :k].tolist()
                    )
    if prompt_logprobs is not None:
        record_prompt_logprobs(plan, prompt_logprobs)
    finished = engine.scheduler.update(plan, sampled)
    for req, _ in plan.scheduled:  # the matcher follows the tokens the request kept
        if req.grammar is None or req.request_id not in sampled:
            continue
        new_ids = [t for t in req.output_token_ids[plan.outputs[req.request_id]:] if t is not None]
        if not req.grammar.accept(new_ids) and not req.is_finished:
            req.error = "the grammar allows no token here (is every allowed token biased to -inf?)"
            engine.abort(req, "error")
            finished.append(req)
    for req in finished:
        engine._seeds.pop(req.request_id, None)
        del req.logits[len(req.output_token_ids) :]  # logits of steps run past a stop
        for index in [i for i in req.token_logprobs if i >= len(req.output_token_ids)]:
            del req.token_logprobs[index]
    interval = engine.config.eplb_step_interval
    if interval and engine.num_steps % interval == 0:  # between steps: the next one is already planned
        from deepinfer.runtime.expert_balance import rebalance

        rebalance(engine)
    return finished


def record_prompt_logprobs(plan: StepPlan, arrays: tuple) -> None:
    """Each wanted prompt position p >= 1: logprob of prompt[p] given the tokens before it."""
    chosen, ids, lps = (np.asarray(a) for a in arrays)
    offset = 0
    for req, n in plan.scheduled:
        k = req.sampling_params.prompt_logprobs
        start = plan.starts[req.request_id]
        if k is not None and not req.is_finished:
            for j in range(n):
                pos = start + j + 1  # the prompt position this token predicts
                if pos < len(req.prompt_token_ids) and pos not in req.prompt_logprobs:
                    t = offset + j
                    req.prompt_logprobs[pos] = (float(chosen[t]), ids[t, :k].tolist(), lps[t, :k].tolist())
        offset += n
