"""Shared engine workloads: ten requests of mixed lengths, how to drain them through an engine,
and the reference of each request run alone through generate()."""

import numpy as np

import deepinfer

ENGINE_KW = dict(max_num_seqs=8, max_model_len=96, page_size=4, token_buckets=(8, 32), row_buckets=(8,))
PROMPT_LENS = [1, 2, 5, 9, 17, 23, 31, 40, 47, 60]
MAX_TOKENS = [4, 12, 7, 12, 5, 9, 12, 3, 10, 8]


def workload(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS]


def drain(engine, prompts, params_for, arrive_per_step=2, first=4):
    """Add `first` requests, then `arrive_per_step` more after every step; run to the end."""
    reqs, pending = [], list(range(len(prompts)))
    for _ in range(first):
        i = pending.pop(0)
        reqs.append(engine.add_request(prompts[i], params_for(i), request_id=f"r{i}"))
    while engine.has_unfinished or pending:
        engine.step()
        for _ in range(arrive_per_step):
            if pending:
                i = pending.pop(0)
                reqs.append(engine.add_request(prompts[i], params_for(i), request_id=f"r{i}"))
    engine.check_all_free()  # the allocator invariant, after every engine workload
    return {r.request_id: r for r in reqs}


def alone(case, prompt, max_tokens, **sampling):
    """The request run alone through the incremental-decoding path (fixed shapes: one compile)."""
    arr = np.zeros((1, 64), np.int32)
    arr[0, : len(prompt)] = prompt
    out = deepinfer.generate(case.cfg, case.params, arr, [len(prompt)], max_new_tokens=12, max_tokens=max_tokens, max_len=96, **sampling)
    toks = np.asarray(out.tokens[0])
    return toks[toks >= 0].tolist()
