"""The HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/health, /metrics, /debug/engine.

Every request is parsed and checked (serve/checks.py: size, UTF-8, JSON, fields, model
name, vocabulary, length, queue room) before anything reaches the engine thread; the
responses are written by serve/streaming.py. A request with n choices (or several
prompts) runs as one engine sequence per choice; their outputs are merged there.
The OpenAPI document publishes the pydantic request models as the request bodies
(the handlers read the raw body themselves, to bound it before parsing).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from deepinfer.serve.async_engine import AsyncEngine
from deepinfer.serve.checks import (
    at_most,
    check_auth,
    check_room,
    check_sampling,
    check_text,
    parse,
    read_json,
    resolve_max_tokens,
    token_ids,
)
from deepinfer.serve.errors import APIError, ClientGone, bad_request
from deepinfer.serve.formatting import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_listing,
    usage,
)
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_not_yet,
)
from deepinfer.serve.streaming import (
    collect,
    event_stream,
    include_usage,
    sequences,
    stream_chat,
    stream_completion,
)
from deepinfer.text.tokenizer import ChatTemplateError, TextTokenizer

log = logging.getLogger("deepinfer.serve")
ROLES = ("system", "developer", "user", "assistant")
REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: TextTokenizer | None
    model_name: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_waiting: int  # sequences allowed to wait beyond max_num_seqs before 503
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    aliases: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM (serve/shutdown.py): new generation requests get 503

    def __post_init__(self):
        self.text_of = TokenText(self.tokenizer.tokenizer if self.tokenizer else None)


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name and name not in state.aliases:
        raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}", "model")


def encode(state: ServerState, text: str, what: str, add_special_tokens: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise bad_request(f"this model has no tokenizer: send {what} as token ids", what)
    return state.tokenizer.encode(check_text(text, what), add_special_tokens=add_special_tokens)


def openapi_document(app: FastAPI) -> dict:
    """FastAPI's document, with each POST route's pydantic model as its JSON request body."""
    doc = get_openapi(title=app.title, version="1", routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.state.deepinfer = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        log.info("%s", exc)  # nobody is left to read a response
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/health")
    async def health():
        if state.draining:  # load balancers stop sending here while the streams in flight finish
            raise APIError(503, "the server is shutting down")
        if not state.engine.alive:
            raise APIError(503, "the engine loop is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/engine")
    async def debug_engine(request: Request):
        check_auth(state.api_key, request)
        snap = state.engine.snapshot
        return {"running": snap.running, "waiting": snap.waiting, "kv_usage": snap.kv_usage,
                "pages_used": snap.pages_used, "slots_used": snap.slots_used,
                "sequences_in_flight": state.engine.in_system, "num_preemptions": snap.num_preemptions,
                "spec_decode": {"num_drafts": snap.num_drafts, "num_draft_tokens": snap.num_draft_tokens,
                                "num_accepted_tokens": snap.num_accepted_tokens,
                                "accepted_per_position": list(snap.accepted_per_position)}}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(state.api_key, request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "root": state.model_name, "max_model_len": state.max_model_len,
        }]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
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

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_auth(state.api_key, request)
        req = parse(DetokenizeRequest, await read_json(request, state.max_body_bytes, f"detok-{uuid.uuid4().hex}"))
        check_model(state, req.model)
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        token_ids(req.tokens, "tokens", state.vocab_size, allow_empty=True)
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def generation_request(request: Request, model: type[BaseModel], rid: str):
        """The checks every generation endpoint starts with; returns (parsed request, arrival time)."""
        arrival = time.monotonic()
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Connection": "close"})
        check_auth(state.api_key, request)
        raw = await read_json(request, state.max_body_bytes, rid)
        check_not_yet(raw)
        req = parse(model, raw)
        check_model(state, req.model)
        return req, arrival

    @app.post("/v1/completions")
    async def completions(request: Request):
        rid = f"cmpl-{uuid.uuid4().hex}"
        req, arrival = await generation_request(request, CompletionRequest, rid)
        prompts = completion_prompts(state, req.prompt)
        given = "max_tokens" in req.model_fields_set
        max_tokens = [resolve_max_tokens(state.max_model_len, len(p), req.max_tokens if given else None, "max_tokens")
                      for p in prompts]
        if not given:  # OpenAI's default of 16, shortened to what fits
            max_tokens = [min(16, m) for m in max_tokens]
        sps = [req.sampling_params(m, req.logprobs) for m in max_tokens]
        for sp in sps:
            check_sampling(state, sp)
        seqs = sequences(rid, prompts, sps)
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
            "choices": choices, "usage": usage(n_prompt, sum(len(c.token_ids) for c in results.values())),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        req, arrival = await generation_request(request, ChatCompletionRequest, rid)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        prompt = encode(state, render_chat(state, req.messages, req.add_generation_prompt), "messages", False)
        token_ids(prompt, "messages", state.vocab_size)
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(state.max_model_len, len(prompt), req.max_completion_tokens or req.max_tokens,
                                        field_name, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sp = req.sampling_params(max_tokens, logprobs)
        check_sampling(state, sp)
        seqs = sequences(rid, [prompt], [sp])
        check_room(state, len(seqs), "n")
        if req.stream:
            return event_stream(rid, stream_chat(state, rid, seqs, arrival, len(prompt), include_usage(req),
                                                 logprobs is not None))
        results = await collect(state, rid, seqs, arrival, request)
        choices = []
        for seq in seqs:
            c = results[seq.index]
            choices.append({
                "index": seq.index, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, state.text_of) if logprobs is not None else None,
            })
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(len(prompt), sum(len(c.token_ids) for c in results.values())),
        }

    return app


def completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    vocab = state.vocab_size
    if isinstance(prompt, str):
        return [token_ids(encode(state, prompt, "prompt"), "prompt", vocab)]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [token_ids(list(prompt), "prompt", vocab)]
    # several prompts: each is a sequence, so more than the server can hold can never run
    at_most(prompt, "prompt", state.max_num_seqs + state.max_waiting, "prompts")
    if all(isinstance(p, str) for p in prompt):
        return [token_ids(encode(state, p, f"prompt[{i}]"), f"prompt[{i}]", vocab) for i, p in enumerate(prompt)]
    return [token_ids(list(p), f"prompt[{i}]", vocab) for i, p in enumerate(prompt)]


def render_chat(state: ServerState, messages, add_generation_prompt: bool) -> str:
    plain = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}]: unknown role {m.role!r} (expected one of {', '.join(ROLES)})", f"messages[{i}].role")
        extra = sorted(set(m.model_extra or {}))
        if extra:
            raise bad_request(f"messages[{i}]: unsupported field(s) {', '.join(extra)}", f"messages[{i}]")
        content = m.content if isinstance(m.content, str) or m.content is None else [p.model_dump() for p in m.content]
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
        plain.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    try:
        return state.tokenizer.apply_chat_template(plain, add_generation_prompt)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None


