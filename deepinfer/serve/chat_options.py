"""How a chat request shapes its prompt: the template (the model's, or the request's own
under --trust-request-chat-template), its extra variables (vLLM's chat_template_kwargs),
and DeepSeek's thinking switch (``{"thinking": true}``, or OpenAI's ``reasoning_effort``:
anything but "none" turns it on; the effort itself is passed to the template)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from deepinfer.serve.errors import bad_request
from deepinfer.serve.server_state import encode
from deepinfer.text.reasoning import THINK_END

RESERVED = ("messages", "add_generation_prompt", "tools_prompt", "bos_token", "eos_token")
MAX_TEMPLATE_CHARS = 64 << 10


@dataclass
class TemplateOptions:
    chat_template: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def template_options(state, req) -> TemplateOptions:
    kwargs = dict(req.chat_template_kwargs or {})
    taken = [k for k in RESERVED if k in kwargs]
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)} (the server sets them)",
                          "chat_template_kwargs")
    if req.reasoning_effort is not None:
        thinking = kwargs.setdefault("thinking", req.reasoning_effort != "none")
        if bool(thinking) != (req.reasoning_effort != "none"):
            raise bad_request(f"reasoning_effort {req.reasoning_effort!r} and chat_template_kwargs.thinking "
                              f"{thinking!r} disagree", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.chat_template is not None:
        if not state.trust_request_chat_template:
            raise bad_request("chat_template in a request needs --trust-request-chat-template (a template is code "
                              "the server runs, sandboxed)", "chat_template")
        if len(req.chat_template) > MAX_TEMPLATE_CHARS:
            raise bad_request(f"chat_template has {len(req.chat_template)} characters; at most {MAX_TEMPLATE_CHARS} "
                              f"are allowed", "chat_template")
    return TemplateOptions(req.chat_template, kwargs)


def with_thinking_budget(state, sp, budget: int | None, thinking: bool, how: str):
    """sp with vLLM's thinking_token_budget (the end marker's ids from the tokenizer); refused when
    the prompt opened no reasoning (``how`` says how a request turns thinking on)."""
    if budget is None:
        return sp
    if not thinking:
        raise bad_request(f"thinking_token_budget needs thinking on ({how}) and a template that opens the reasoning",
                          "thinking_token_budget")
    try:
        return dataclasses.replace(sp, thinking_token_budget=budget,
                                   reasoning_end_token_ids=tuple(encode(state, THINK_END, "thinking_token_budget", False)))
    except ValueError as e:
        raise bad_request(str(e), "thinking_token_budget") from None
