"""POST /v1/chat/completions: the conversation rendered through the chat template (thinking,
tools, the request's template options), one output constraint, n choices, streamed or not.

With thinking on (the prompt ends inside ``<think>``), the reasoning comes back as
``reasoning_content`` and the answer as ``content`` (text/reasoning.py); an output
constraint or tool calls apply to the answer, after the reasoning ends.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request

from deepinfer.serve.chat_options import template_options, with_thinking_budget
from deepinfer.serve.checks import (
    check_room,
    check_sampling,
    resolve_max_tokens,
    token_ids,
)
from deepinfer.serve.errors import bad_request
from deepinfer.serve.formatting import chat_logprobs, text_of_request, usage
from deepinfer.serve.prologue import generation_request
from deepinfer.serve.protocol import ChatCompletionRequest
from deepinfer.serve.server_state import encode, render_chat
from deepinfer.serve.streaming import (
    cached_tokens,
    collect,
    event_stream,
    include_usage,
    sequences,
    stream_chat,
)
from deepinfer.serve.structured import compile_grammar, constraint_field
from deepinfer.serve.tools import plan_tools
from deepinfer.text.reasoning import THINK_END, opens_reasoning, split_reasoning
from deepinfer.text.tool_format import parse_tool_calls


def chat_message(text: str, thinking: bool, parse_tools: bool) -> tuple[dict, bool]:
    """The assistant message of one output, and whether it made tool calls."""
    message = {"role": "assistant", "content": text}
    if thinking:
        message["reasoning_content"], message["content"] = split_reasoning(text)
    calls = []
    if parse_tools and message["content"] is not None:
        message["content"], calls = parse_tool_calls(message["content"])
        message["tool_calls"] = [t.openai() for t in calls]
    return message, bool(calls)


async def chat_completions(request: Request):
    state = request.app.state.deepinfer
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    req, arrival = await generation_request(request, ChatCompletionRequest, rid)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    options = template_options(state, req)
    tools = plan_tools(state, req)
    text = render_chat(state, req.messages, req.add_generation_prompt, tools.prompt, req.continue_final_message, options)
    thinking = opens_reasoning(text)
    if thinking and tools.spec is not None:  # the calls' grammar starts after the reasoning
        tools = plan_tools(state, req, reasoning=True)
    prompt = req.truncate(encode(state, text, "messages", req.add_special_tokens), state.max_model_len)
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
    elif thinking and sp.structured_outputs is not None:
        sp = dataclasses.replace(sp, structured_outputs=dataclasses.replace(sp.structured_outputs, reasoning_end=THINK_END))
    sp = with_thinking_budget(state, sp, req.thinking_token_budget, thinking,
                              'chat_template_kwargs {"thinking": true} or reasoning_effort')
    check_sampling(state, sp)
    grammar = await compile_grammar(state, sp.structured_outputs, field)
    seqs = sequences(rid, [prompt], [sp], [grammar], req.cache_salt, req.priority)
    check_room(state, len(seqs), "n")
    text_of = text_of_request(state, req)
    if req.stream:
        return event_stream(rid, stream_chat(state, rid, seqs, arrival, len(prompt), include_usage(req),
                                             logprobs is not None, tools.parse, thinking, text_of))
    results = await collect(state, rid, seqs, arrival, request)
    choices = []
    for seq in seqs:
        c = results[seq.index]
        message, called = chat_message(c.text, thinking, tools.parse)
        choices.append({
            "index": seq.index, "message": message,
            "finish_reason": "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason,
            "stop_reason": c.stop_reason,
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, text_of) if logprobs is not None else None,
        })
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(len(prompt), sum(len(c.token_ids) for c in results.values()),
                                               cached_tokens(seqs))}
    if req.service_tier is not None:
        body["service_tier"] = "default"
    return body
