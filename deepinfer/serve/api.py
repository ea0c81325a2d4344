"""The HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/health, /metrics, /debug/engine.

Every request is parsed and checked here (size, UTF-8, JSON, fields, model name,
vocabulary, length, queue room) before anything reaches the engine thread.
A request with n choices (or several prompts) runs as one engine sequence per
choice; their outputs are merged here.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from deepinfer.engine.output import ChoiceDelta, ChoiceOutput
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.serve.async_engine import AsyncEngine
from deepinfer.serve.errors import APIError, bad_request
from deepinfer.serve.formatting import (
    SSE_DONE,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_listing,
    sse,
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
from deepinfer.tokenizer import ChatTemplateError, TextTokenizer

ROLES = ("system", "developer", "user", "assistant")


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
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.text_of = TokenText(self.tokenizer.tokenizer if self.tokenizer else None)


@dataclass
class Sequence:
    index: int  # choice index in the response
    request_id: str
    prompt_ids: list[int]
    sp: SamplingParams


# -- request checks ---------------------------------------------------------------


async def read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at position {e.start})") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"malformed JSON in request body: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def parse(model: type[BaseModel], raw: dict) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        msgs, first = [], None
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            first = first or loc
            if err["type"] == "extra_forbidden":
                msgs.append(f"unknown field {loc!r}")
            elif err["type"] == "missing":
                msgs.append(f"missing field {loc!r}")
            else:
                msgs.append(f"{loc}: {err['msg']}")
        raise bad_request("invalid request: " + "; ".join(dict.fromkeys(msgs)), first) from None


def check_auth(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), state.api_key):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name and name not in state.aliases:
        raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}", "model")


def check_text(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{what} is not valid Unicode (lone surrogate at position {e.start})", what) from None
    return text


def encode(state: ServerState, text: str, what: str, add_special_tokens: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise bad_request(f"this model has no tokenizer: send {what} as token ids", what)
    return state.tokenizer.encode(check_text(text, what), add_special_tokens=add_special_tokens)


def check_ids(state: ServerState, ids: list[int], what: str) -> list[int]:
    if not ids:
        raise bad_request(f"{what} is empty", what)
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise bad_request(f"{what} has token ids {bad[:8]} outside the vocabulary [0, {state.vocab_size})", what)
    return ids


def check_sampling_ids(state: ServerState, sp: SamplingParams) -> None:
    for name, ids in (("logit_bias", list(sp.logit_bias)), ("stop_token_ids", sp.stop_token_ids)):
        bad = [t for t in ids if t >= state.vocab_size]
        if bad:
            raise bad_request(f"{name} has token ids {bad[:8]} outside the vocabulary [0, {state.vocab_size})", name)


def resolve_max_tokens(state: ServerState, n_prompt: int, requested: int | None, field_name: str) -> int:
    limit = state.max_model_len
    if n_prompt >= limit:
        raise bad_request(
            f"the prompt has {n_prompt} tokens but this model's maximum context length (max_model_len) is {limit} "
            f"tokens, and at least one token must be generated", "prompt"
        )
    if requested is None:
        return limit - n_prompt
    if requested < 1:
        raise bad_request(f"{field_name} must be at least 1, got {requested}", field_name)
    if n_prompt + requested > limit:
        raise bad_request(
            f"this model's maximum context length (max_model_len) is {limit} tokens; the request asks for "
            f"{n_prompt + requested} ({n_prompt} in the prompt, {requested} to generate): lower {field_name}",
            field_name,
        )
    return requested


def check_room(state: ServerState, n_new: int) -> None:
    limit = state.max_num_seqs + state.max_waiting
    if state.engine.in_system + n_new > limit:
        raise APIError(
            503, f"the server is at capacity ({state.engine.in_system} sequences in flight, limit {limit}); retry later",
            headers={"Retry-After": "1"},
        )


def sequences(prefix: str, prompts: list[list[int]], sps: list[SamplingParams]) -> list[Sequence]:
    """One engine sequence per (prompt, choice); prompt i's choices get indices i*n .. i*n + n - 1."""
    out = []
    for i, (ids, sp) in enumerate(zip(prompts, sps)):
        for j, choice in enumerate(sp.choices()):
            out.append(Sequence(i * sp.n + j, f"{prefix}-{i}-{j}", ids, choice))
    return out


# -- running sequences ----------------------------------------------------------------


async def run(
    state: ServerState, seqs: list[Sequence], arrival: float, choices: dict[int, ChoiceOutput] | None = None
) -> AsyncIterator[tuple[Sequence, ChoiceDelta | None, str | None]]:
    """Merge the outputs of several sequences: yields (sequence, delta, error) as they arrive.
    ``choices``, when given, receives each sequence's accumulated ChoiceOutput by choice index."""
    out: asyncio.Queue = asyncio.Queue()
    tok = state.tokenizer.tokenizer if state.tokenizer else None
    m = state.metrics

    async def pump(seq: Sequence):
        choice = ChoiceOutput(seq.index, seq.sp, tok)
        if choices is not None:
            choices[seq.index] = choice
        gen = state.engine.generate(seq.request_id, seq.prompt_ids, seq.sp)
        m.prompt_tokens.inc(len(seq.prompt_ids))
        last, failed = None, False
        try:
            async for upd in gen:
                if upd.error is not None:
                    failed = True
                    m.finished("error")
                    await out.put((seq, None, upd.error))
                    return
                if upd.token_ids:
                    if last is None:  # the first tokens: queue time and time to first token
                        if upd.first_scheduled_time is not None:
                            m.request_queue_time.observe(max(0.0, upd.first_scheduled_time - arrival))
                        m.time_to_first_token.observe(upd.time - arrival)
                    else:  # tokens that arrived together share the gap since the last ones
                        for _ in upd.token_ids:
                            m.inter_token_latency.observe((upd.time - last) / len(upd.token_ids))
                    last = upd.time
                delta = choice.add(upd.token_ids, upd.logprobs, upd.finish_reason)
                if upd.prompt_logprobs is not None:
                    delta.prompt_logprobs = choice.prompt_logprobs = upd.prompt_logprobs
                m.generation_tokens.inc(len(delta.token_ids))
                if delta.finish_reason is not None:
                    m.e2e_request_latency.observe(time.monotonic() - arrival)
                    m.finished(delta.finish_reason)
                await out.put((seq, delta, None))
                if choice.finished:
                    return  # a stop string ends it early: closing gen aborts the engine request
        finally:
            if not choice.finished and not failed:
                m.finished("abort")  # the client went away (or the server is stopping)
            await gen.aclose()
            await out.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in seqs]
    remaining = len(tasks)
    try:
        while remaining:
            item = await out.get()
            if item is None:
                remaining -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(state: ServerState, seqs: list[Sequence], arrival: float, request: Request) -> dict[int, ChoiceOutput]:
    """Run to completion (non-streaming): each choice's output by index. A client that goes
    away cancels its sequences."""
    results: dict[int, ChoiceOutput] = {}

    async def gather():
        async for _, _, error in run(state, seqs, arrival, results):
            if error is not None:
                raise APIError(500, f"generation failed: {error}")

    task = asyncio.create_task(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                return results
            if await request.is_disconnected():
                raise asyncio.CancelledError
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


# -- the app ------------------------------------------------------------------------------


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="deepinfer", lifespan=lifespan)
    app.state.deepinfer = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            raise APIError(503, "the engine loop is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/engine")
    async def debug_engine(request: Request):
        check_auth(state, request)
        snap = state.engine.snapshot
        return {"running": snap.running, "waiting": snap.waiting, "kv_usage": snap.kv_usage,
                "pages_used": snap.pages_used, "slots_used": snap.slots_used,
                "sequences_in_flight": state.engine.in_system, "num_preemptions": snap.num_preemptions}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(state, request)
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "deepinfer",
            "root": state.model_name, "max_model_len": state.max_model_len,
        }]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_auth(state, request)
        req = parse(TokenizeRequest, await read_json(request, state.max_body_bytes))
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
        check_auth(state, request)
        req = parse(DetokenizeRequest, await read_json(request, state.max_body_bytes))
        check_model(state, req.model)
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise bad_request(f"tokens {bad[:8]} are outside the vocabulary [0, {state.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def generation_request(request: Request, model: type[BaseModel]):
        """The checks every generation endpoint starts with; returns (parsed request, arrival time)."""
        arrival = time.monotonic()
        check_auth(state, request)
        raw = await read_json(request, state.max_body_bytes)
        check_not_yet(raw)
        req = parse(model, raw)
        check_model(state, req.model)
        return req, arrival

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, arrival = await generation_request(request, CompletionRequest)
        prompts = completion_prompts(state, req.prompt)
        given = "max_tokens" in req.model_fields_set
        max_tokens = [resolve_max_tokens(state, len(p), req.max_tokens if given else None, "max_tokens") for p in prompts]
        if not given:  # OpenAI's default of 16, shortened to what fits
            max_tokens = [min(16, m) for m in max_tokens]
        sps = [req.sampling_params(m, req.logprobs) for m in max_tokens]
        for sp in sps:
            check_sampling_ids(state, sp)
        rid = f"cmpl-{uuid.uuid4().hex}"
        seqs = sequences(rid, prompts, sps)
        check_room(state, len(seqs))
        n_prompt = sum(len(p) for p in prompts)
        if req.stream:
            return event_stream(stream_completion(state, rid, seqs, arrival, n_prompt, include_usage(req),
                                                  req.logprobs is not None))
        results = await collect(state, seqs, arrival, request)
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
        req, arrival = await generation_request(request, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        prompt = encode(state, render_chat(state, req.messages, req.add_generation_prompt), "messages", False)
        check_ids(state, prompt, "messages")
        if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
        field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(state, len(prompt), req.max_completion_tokens or req.max_tokens, field_name)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sp = req.sampling_params(max_tokens, logprobs)
        check_sampling_ids(state, sp)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        seqs = sequences(rid, [prompt], [sp])
        check_room(state, len(seqs))
        if req.stream:
            return event_stream(stream_chat(state, rid, seqs, arrival, len(prompt), include_usage(req), logprobs is not None))
        results = await collect(state, seqs, arrival, request)
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


def include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def event_stream(chunks) -> StreamingResponse:
    """An SSE response over an async iterator of ``data: ...`` lines."""
    return StreamingResponse(chunks, media_type="text/event-stream")


def completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [check_ids(state, encode(state, prompt, "prompt"), "prompt")]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [check_ids(state, list(prompt), "prompt")]
    if all(isinstance(p, str) for p in prompt):
        return [check_ids(state, encode(state, p, f"prompt[{i}]"), f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [check_ids(state, list(p), f"prompt[{i}]") for i, p in enumerate(prompt)]


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


async def stream_completion(state, rid, seqs, arrival, n_prompt, include_usage, want_logprobs):
    created, n_out = int(time.time()), 0
    offsets = {s.index: 0 for s in seqs}
    async for seq, delta, error in run(state, seqs, arrival):
        if error is not None:
            yield sse(APIError(500, f"generation failed: {error}").body())
            break
        n_out += len(delta.token_ids)
        if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.token_ids) \
                and delta.prompt_logprobs is None:
            continue  # nothing to show yet (e.g. half a UTF-8 character)
        lp = None
        if want_logprobs:
            lp = completion_logprobs(delta.token_ids, delta.logprobs, state.text_of, offsets[seq.index])
            offsets[seq.index] += sum(len(t) for t in lp["tokens"])
        choice = {"index": seq.index, "text": delta.text, "logprobs": lp,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if delta.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_listing(seq.prompt_ids, delta.prompt_logprobs, state.text_of)
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [choice]})
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [], "usage": usage(n_prompt, n_out)})
    yield SSE_DONE


async def stream_chat(state, rid, seqs, arrival, n_prompt, include_usage, want_logprobs):
    created, n_out = int(time.time()), 0

    def chunk(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name, "choices": choices}

    for s in seqs:
        yield sse(chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
    async for seq, delta, error in run(state, seqs, arrival):
        if error is not None:
            yield sse(APIError(500, f"generation failed: {error}").body())
            break
        n_out += len(delta.token_ids)
        if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.token_ids):
            continue  # nothing to show yet (e.g. half a UTF-8 character)
        yield sse(chunk([{
            "index": seq.index, "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
            "logprobs": chat_logprobs(delta.token_ids, delta.logprobs, state.text_of) if want_logprobs else None,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
        }]))
    if include_usage:
        yield sse({**chunk([]), "usage": usage(n_prompt, n_out)})
    yield SSE_DONE
