"""The HTTP routes: /health, /metrics, /debug/engine, /v1/models, /tokenizer_info, /tokenize,
/detokenize here; /v1/completions (serve/completions.py), /v1/chat/completions
(serve/chat.py) and /v1/responses (serve/responses.py). ``ROUTES`` lists them for build_app.

Every handler reads the server's state from the app (``request.app.state.deepinfer``);
requests are checked (serve/checks.py) before anything reaches the engine thread, and
responses are written by serve/streaming.py.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from deepinfer.serve.chat import chat_completions
from deepinfer.serve.checks import check_auth, parse, read_json, token_ids
from deepinfer.serve.completions import completions
from deepinfer.serve.errors import APIError, bad_request
from deepinfer.serve.protocol import DetokenizeRequest, TokenizeRequest
from deepinfer.serve.responses import responses
from deepinfer.serve.server_state import ServerState, check_model, encode, render_chat


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
                             "replayed": snap.prefix_replayed},
            "step_programs": {"ready_token_buckets": list(snap.programs_ready),
                              "compiling_token_buckets": list(snap.programs_compiling)}}


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


async def tokenizer_info(request: Request):
    """vLLM's GET /tokenizer_info: the tokenizer's configuration (special tokens, chat template,
    length), what lm-evaluation-harness' remote tokenizer backend reads."""
    state: ServerState = request.app.state.deepinfer
    check_auth(state.api_key, request)
    tok = state.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer")
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "pad_token": None, "add_bos_token": tok.add_bos_token, "chat_template": tok.chat_template,
            "model_max_length": state.max_model_len, "vocab_size": tok.vocab_size}


# (method, path, handler) for build_app
ROUTES = (
    ("GET", "/health", health),
    ("GET", "/metrics", metrics),
    ("GET", "/debug/engine", debug_engine),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model_id:path}", model),
    ("GET", "/tokenizer_info", tokenizer_info),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/responses", responses),
)
