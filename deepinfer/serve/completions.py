"""POST /v1/completions: prompts (text, token ids, or several), n and best_of choices,
echo / max_tokens 0 scoring and fill in the middle (serve/scoring.py), streamed or not."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request

from deepinfer.serve.best_of import check_best_of, pick_best
from deepinfer.serve.checks import check_room, check_sampling, resolve_max_tokens
from deepinfer.serve.errors import bad_request
from deepinfer.serve.formatting import (
    completion_logprobs,
    prompt_logprobs_listing,
    text_of_request,
    usage,
)
from deepinfer.serve.prologue import generation_request
from deepinfer.serve.protocol import CompletionRequest
from deepinfer.serve.scoring import (
    echo_logprobs,
    echo_text,
    fim_prompt,
    join_logprobs,
    scoring_of,
)
from deepinfer.serve.server_state import completion_prompts
from deepinfer.serve.streaming import (
    cached_tokens,
    collect,
    event_stream,
    include_usage,
    sequences,
    stream_completion,
)
from deepinfer.serve.structured import compile_grammar, constraint_field


def _texts(state, req: CompletionRequest) -> list:
    """The prompts as sent (strings or id lists), with the FIM wrapping when a suffix is given."""
    prompt = req.prompt
    many = isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt)
    items = list(prompt) if many else [prompt]
    if req.suffix is not None:
        if not all(isinstance(p, str) for p in items):
            raise bad_request("suffix needs text prompts (fill in the middle is written as text)", "suffix")
        items = [fim_prompt(state, p, req.suffix) for p in items]
    return items


async def completions(request: Request):
    state = request.app.state.deepinfer
    rid = f"cmpl-{uuid.uuid4().hex}"
    req, arrival = await generation_request(request, CompletionRequest, rid)
    scoring = scoring_of(req)
    best_of = check_best_of(req)
    texts = _texts(state, req)
    prompts = [req.truncate(p, state.max_model_len)
               for p in completion_prompts(state, texts if len(texts) > 1 else texts[0], req.add_special_tokens)]
    given = "max_tokens" in req.model_fields_set
    wanted = 1 if scoring.score_only else (req.max_tokens if given else None)
    max_tokens = [resolve_max_tokens(state.max_model_len, len(p), wanted, "max_tokens") for p in prompts]
    if not given:  # OpenAI's default of 16, shortened to what fits
        max_tokens = [min(16, m) for m in max_tokens]
    k = req.logprobs
    sps = [req.sampling_params(m, k if best_of is None or k is not None else 0) for m in max_tokens]
    if scoring.echo and k is not None:  # the prompt's logprobs, from the prefill on the device
        sps = [dataclasses.replace(sp, prompt_logprobs=max(k, sp.prompt_logprobs or 0)) for sp in sps]
    if best_of is not None:
        sps = [dataclasses.replace(sp, n=best_of) for sp in sps]
    for sp in sps:
        check_sampling(state, sp)
    grammar = await compile_grammar(state, sps[0].structured_outputs, constraint_field(req))
    seqs = sequences(rid, prompts, sps, [grammar] * len(sps), req.cache_salt, req.priority)
    check_room(state, len(seqs), "best_of" if best_of else "n" if req.n > 1 else "prompt")
    n_prompt = sum(len(p) for p in prompts)
    text_of = text_of_request(state, req)
    echoes = [echo_text(state, t, p) if scoring.echo else "" for t, p in zip(texts, prompts)]
    if req.stream:
        return event_stream(rid, stream_completion(state, rid, seqs, arrival, n_prompt, include_usage(req),
                                                   k is not None, text_of, echoes, scoring.score_only,
                                                   req.prompt_logprobs is not None))
    results = await collect(state, rid, seqs, arrival, request)
    n_generated = sum(len(c.token_ids) for c in results.values())
    picked = pick_best(seqs, results, req.n, best_of) if best_of else [(s, results[s.index]) for s in seqs]
    choices = []
    for index, (seq, c) in enumerate(picked):
        ids, lps, text = c.token_ids, c.logprobs, c.text
        if scoring.score_only:  # the one token the engine sampled to end the request is not part of it
            ids, lps, text, n_generated = [], [], "", n_generated - len(c.token_ids)
        logprobs = None
        if k is not None:
            offset = 0
            if scoring.echo:
                head, offset = echo_logprobs(seq.prompt_ids, c.prompt_logprobs or {}, text_of)
            logprobs = completion_logprobs(ids, lps, text_of, offset)
            if scoring.echo:
                logprobs = join_logprobs(head, logprobs)
        choices.append({
            "index": index, "text": echoes[seq.prompt_index] + text, "logprobs": logprobs,
            "finish_reason": "length" if scoring.score_only else c.finish_reason,
            "stop_reason": None if scoring.score_only else c.stop_reason,
            "prompt_logprobs": prompt_logprobs_listing(seq.prompt_ids, c.prompt_logprobs or {}, text_of)
            if req.prompt_logprobs is not None else None,
        })
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(n_prompt, n_generated, cached_tokens(seqs))}
    if req.service_tier is not None:
        body["service_tier"] = "default"
    return body
