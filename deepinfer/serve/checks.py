"""Request checks at the edge: everything a client sends is bounded here, before it reaches
the engine thread, so nothing in a body can make the plan packer or a step raise.

One helper per kind of check, one message format each:
  - ranges:     "<field> must be in [lo, hi], got <value>"
  - token ids:  "<field> has token ids [...] outside the vocabulary [0, V)"
  - lengths:    "<field> has N <things>; at most L are allowed"
The body itself: at most ``max_body_bytes`` (413), UTF-8, one JSON object nested at most
MAX_DEPTH deep, integers of at most MAX_INT_DIGITS digits, finite numbers only.
SamplingParams bounds the sampling fields that do not depend on the model
(engine/sampling_params.py); the model-dependent bounds (vocabulary, context length,
queue room) are checked here.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from deepinfer.scheduler.sampling_params import MAX_BIAS_SLOTS, SamplingParams
from deepinfer.serve.errors import APIError, ClientGone, bad_request

MAX_DEPTH = 32  # the deepest request (chat content parts) nests 5 levels
MAX_INT_DIGITS = 20  # 2**64 has 20 digits; Python refuses to parse more than 4300


def in_range(value, field: str, lo, hi):
    if not lo <= value <= hi:
        raise bad_request(f"{field} must be in [{lo}, {hi}], got {value!r}", field)
    return value


def token_ids(ids: list[int], field: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    if not ids and not allow_empty:
        raise bad_request(f"{field} is empty", field)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{field} has token ids {bad[:8]} outside the vocabulary [0, {vocab_size})", field)
    return ids


def at_most(items, field: str, limit: int, what: str):
    if len(items) > limit:
        raise bad_request(f"{field} has {len(items)} {what}; at most {limit} are allowed", field)
    return items


# -- the body -------------------------------------------------------------------------


async def read_json(request: Request, limit: int, request_id: str) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:
        raise ClientGone(request_id, "while sending the body") from None
    return load_json(bytes(body))


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise bad_request(f"an integer in the request body has {digits} digits; at most {MAX_INT_DIGITS} are allowed")
    return int(text)


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise bad_request(f"the number {text[:40]} in the request body is out of range")
    return x


def _constant(name: str):
    raise bad_request(f"{name} is not valid JSON; send a finite number")


def load_json(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at position {e.start})") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    too_deep = bad_request(f"request body is nested more than {MAX_DEPTH} levels deep")
    try:
        obj = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"malformed JSON in request body: {e}") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body must be a JSON object, got {type(obj).__name__}")
    stack = [(obj, 1)]  # iterative: the depth is bounded before anything recurses into it
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise too_deep
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
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


# -- who and what -----------------------------------------------------------------------


def check_auth(api_key: str | None, request: Request) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")


def check_text(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{what} is not valid Unicode (lone surrogate at position {e.start})", what) from None
    return text


def check_sampling(state, sp: SamplingParams) -> None:
    """The SamplingParams bounds that depend on the model and the server."""
    vocab = state.vocab_size
    if sp.top_k > 0:
        in_range(sp.top_k, "top_k", -1, vocab)
    token_ids(list(sp.logit_bias), "logit_bias", vocab, allow_empty=True)
    token_ids(sp.stop_token_ids, "stop_token_ids", vocab, allow_empty=True)
    if sp.min_tokens:
        blocked = set(sp.stop_token_ids) | set(state.eos_token_ids)
        at_most([*sp.logit_bias, *blocked], "logit_bias", MAX_BIAS_SLOTS,
                "entries with the stop and EOS ids that min_tokens blocks")
    if sp.stop and state.tokenizer is None:
        raise bad_request("stop strings need a tokenizer and this model has none; use stop_token_ids", "stop")


def resolve_max_tokens(max_model_len: int, n_prompt: int, requested: int | None, field_name: str,
                       prompt_field: str = "prompt") -> int:
    limit = max_model_len
    if n_prompt >= limit:
        raise bad_request(
            f"the prompt has {n_prompt} tokens but this model's maximum context length (max_model_len) is {limit} "
            f"tokens, and at least one token must be generated", prompt_field
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


def check_room(state, n_new: int, field: str) -> None:
    """400 for a request that could never fit (retrying cannot help); 503 + Retry-After for one
    that fits once others finish."""
    limit = state.max_num_seqs + state.max_waiting
    if n_new > limit:
        raise bad_request(
            f"the request needs {n_new} sequences (prompts x n) but this server holds at most {limit} at once "
            f"(max-num-seqs {state.max_num_seqs} + max-waiting {state.max_waiting}); split it", field
        )
    if state.engine.in_system + n_new > limit:
        raise APIError(
            503, f"the server is at capacity ({state.engine.in_system} sequences in flight, limit {limit}); retry later",
            headers={"Retry-After": "1"},
        )
