"""The HTTP routes, one function each: /health, /metrics, /debug/engine, /v1/models, /tokenize,
/detokenize, /v1/completions, /v1/chat/completions. ``ROUTES`` lists them for build_app.

Every handler reads the server's state from the app (``request.app.state.deepinfer``);
requests are checked (serve/checks.py) before anything reaches the engine thread, and
responses are written by serve/streaming.py.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from deepinfer.serve.checks import (
    check_auth,
    check_room,
    check_sampling,
    parse,
    read_json,
    resolve_max_tokens,
    token_ids,
)
from deepinfer.serve.errors import APIError, bad_request
from deepinfer.serve.formatting import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_listing,
    usage,
)
from deepinfer.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_not_yet,
)
from deepinfer.serve.server_state import (
    ServerState,
    check_model,
    completion_prompts,
    encode,
    render_chat,
)
from deepinfer.serve.streaming import (
    cached_tokens,
    collect,
    event_stream,
    include_usage,
    sequences,
    stream_chat,
    stream_completion,
)
from deepinfer.serve.structured import compile_grammar, constraint_field
from deepinfer.serve.tools import plan_tools
from deepinfer.text.tool_format import parse_tool_calls


async def health(request: Request):
    state: ServerState = request.app.state.deepinfer
    if state.draining:  # load balancers stop sending here while the streams in flight finish
        raise APIError(503, "the server is shutting down")
    if not state.engine.alive:
        raise APIError(503, "the engine loop is not running")
    return {"status": "ok"}


async def metrics(request: Request):
    state: ServerState = request.app.state.deepinfer
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def debug_engine(request: Request):
    state: ServerState = request.app.state.deepinfer
    check_auth(state.api_key, request)
    snap = state.engine.snapshot
    return {"running": snap.running, "waiting": snap.waiting, "kv_usage": snap.kv_usage,
            "pages_used": snap.pages_used, "slots_used": snap.slots_used,
            "sequences_in_flight": state.engine.in_system, "num_preemptions": snap.num_preemptions,
            "spec_decode": {"num_drafts": snap.num_drafts, "num_draft_tokens": snap.num_draft_tokens,
                            "num_accepted_tokens": snap.num_accepted_tokens,
                            "accepted_per_position": list(snap.accepted_per_position)},
            "prefix_cache": {"pages_used": snap.pages_used, "pages_cached": snap.pages_cached,
                             "pages_free": snap.pages_free, "blocks": snap.cached_blocks, "snapshots": snap.snapshots,
                             "queries": snap.prefix_queries, "hits": snap.prefix_hits,
                             "replayed": snap.prefix_replayed}}


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "root": state.model_name, "max_model_len": state.max_model_len}


async def models(request: Request):
    state: ServerState = request.app.state.deepinfer
    check_auth(state.api_key, request)
    return {"object": "list", "data": [_model_card(state)]}


async def model(request: Request):
    """GET /v1/models/{model_id}: the card of the served model (its name or an alias), else a 404."""
    state: ServerState = request.app.state.deepinfer
    check_auth(state.api_key, request)
    check_model(state, request.path_params["model_id"])
    return _model_card(state)


async def tokenize(request: Request):
    state: ServerState = request.app.state.deepinfer
    check_auth(state.api_key, request)
    req = parse(TokenizeRequest, await read_json(request, state.max_body_bytes, f"tok-{uuid.uuid4().hex}"))
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    if req.messages is not None:
        ids = encode(state, render_chat(state, req.messages, req.add_generation_prompt), "messages", False)
    else:
        ids = encode(state, req.prompt, "prompt", req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


async def detokenize(request: Request):
    state: ServerState = request.app.state.deepinfer
    check_auth(state.api_key, request)
    req = parse(DetokenizeRequest, await read_json(request, state.max_body_bytes, f"detok-{uuid.uuid4().hex}"))
    check_model(state, req.model)
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer")
    token_ids(req.tokens, "tokens", state.vocab_size, allow_empty=True)
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}


async def generation_request(request: Request, model: type[BaseModel], rid: str):
    """The checks every generation endpoint starts with; returns (parsed request, arrival time)."""
    state: ServerState = request.app.state.deepinfer
    arrival = time.monotonic()
    if state.draining:
        raise APIError(503, "the server is shutting down", headers={"Connection": "close"})
    check_auth(state.api_key, request)
    raw = await read_json(request, state.max_body_bytes, rid)
    check_not_yet(raw)
    req = parse(model, raw)
    check_model(state, req.model)
    return req, arrival


async def completions(request: Request):
    state: ServerState = request.app.state.deepinfer
    rid = f"cmpl-{uuid.uuid4().hex}"
    req, arrival = await generation_request(request, CompletionRequest, rid)
    prompts = [req.truncate(p, state.max_model_len) for p in completion_prompts(state, req.prompt)]
    given = "max_tokens" in req.model_fields_set
    max_tokens = [resolve_max_tokens(state.max_model_len, len(p), req.max_tokens if given else None, "max_tokens")
                  for p in prompts]
    if not given:  # OpenAI's default of 16, shortened to what fits
        max_tokens = [min(16, m) for m in max_tokens]
    sps = [req.sampling_params(m, req.logprobs) for m in max_tokens]
    for sp in sps:
        check_sampling(state, sp)
    grammar = await compile_grammar(state, sps[0].structured_outputs, constraint_field(req))
    seqs = sequences(rid, prompts, sps, [grammar] * len(sps), req.cache_salt)
    check_room(state, len(seqs), "n" if req.n > 1 else "prompt")
    n_prompt = sum(len(p) for p in prompts)
    if req.stream:
        return event_stream(rid, stream_completion(state, rid, seqs, arrival, n_prompt, include_usage(req),
                                                   req.logprobs is not None))
    results = await collect(state, rid, seqs, arrival, request)
    choices = []
    for seq in seqs:
        c = results[seq.index]
        choices.append({
            "index": seq.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "logprobs": completion_logprobs(c.token_ids, c.logprobs, state.text_of, 0) if req.logprobs is not None else None,
            "prompt_logprobs": prompt_logprobs_listing(seq.prompt_ids, c.prompt_logprobs or {}, state.text_of)
            if req.prompt_logprobs is not None else None,
        })
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices, "usage": usage(n_prompt, sum(len(c.token_ids) for c in results.values()), cached_tokens(seqs)),
    }


async def chat_completions(request: Request):
    state: ServerState = request.app.state.deepinfer
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    req, arrival = await generation_request(request, ChatCompletionRequest, rid)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    tools = plan_tools(state, req)
    text = render_chat(state, req.messages, req.add_generation_prompt, tools.prompt, req.continue_final_message)
    prompt = req.truncate(encode(state, text, "messages", False), state.max_model_len)
    token_ids(prompt, "messages", state.vocab_size)
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
    field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(state.max_model_len, len(prompt), req.max_completion_tokens or req.max_tokens,
                                    field_name, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sp = req.sampling_params(max_tokens, logprobs)
    field = constraint_field(req)
    if tools.spec is not None:
        if sp.structured_outputs is not None:
            raise bad_request(f"send one output constraint: tools (tool_choice) and {field}", field)
        try:
            sp = dataclasses.replace(sp, structured_outputs=tools.spec)
        except ValueError as e:
            raise bad_request(f"tools: {e}", "tools") from None
        field = "tools"
    check_sampling(state, sp)
    grammar = await compile_grammar(state, sp.structured_outputs, field)
    seqs = sequences(rid, [prompt], [sp], [grammar], req.cache_salt)
    check_room(state, len(seqs), "n")
    if req.stream:
        return event_stream(rid, stream_chat(state, rid, seqs, arrival, len(prompt), include_usage(req),
                                             logprobs is not None, tools.parse))
    results = await collect(state, rid, seqs, arrival, request)
    choices = []
    for seq in seqs:
        c = results[seq.index]
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if tools.parse:
            content, calls = parse_tool_calls(c.text)
            message = {"role": "assistant", "content": content, "tool_calls": [t.openai() for t in calls]}
            reason = "tool_calls" if calls and reason == "stop" else reason
        choices.append({
            "index": seq.index, "message": message,
            "finish_reason": reason, "stop_reason": c.stop_reason,
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, state.text_of) if logprobs is not None else None,
        })
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices, "usage": usage(len(prompt), sum(len(c.token_ids) for c in results.values()),
                                           cached_tokens(seqs)),
    }


# (method, path, handler) for build_app
ROUTES = (
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
    ("GET", "/debug/engine", debug_engine),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model_id:path}", model),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
)
