"""What every generation endpoint starts with: draining, auth, the bounded body, the fields
deepinfer refuses, the parse and the model name; and the checks of vLLM's ``priority``."""

from __future__ import annotations

import time

from fastapi import Request
from pydantic import BaseModel

from deepinfer.serve.checks import check_auth, parse, read_json
from deepinfer.serve.errors import APIError, bad_request
from deepinfer.serve.protocol import check_not_yet
from deepinfer.serve.server_state import check_model


async def generation_request(request: Request, model: type[BaseModel], rid: str):
    """The parsed request and its arrival time."""
    state = request.app.state.deepinfer
    arrival = time.monotonic()
    if state.draining:
        raise APIError(503, "the server is shutting down", headers={"Connection": "close"})
    check_auth(state.api_key, request)
    raw = await read_json(request, state.max_body_bytes, rid)
    check_not_yet(raw)
    req = parse(model, raw)
    check_model(state, req.model)
    check_priority(state, getattr(req, "priority", 0))
    return req, arrival


def check_priority(state, priority: int) -> None:
    """A priority means something only under --scheduling-policy priority; elsewhere it would be
    silently ignored, so it is refused (vLLM does the same)."""
    policy = state.engine.engine.config.scheduling_policy
    if priority and policy != "priority":
        raise bad_request(f"priority {priority} needs --scheduling-policy priority (this server schedules {policy})",
                          "priority")
