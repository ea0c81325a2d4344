"""``POST /v1/responses``: OpenAI's Responses API, as vLLM serves it, on top of the chat path.

The request (serve/responses_protocol.py) becomes a conversation rendered with the chat template,
sampled with chat's defaults and constrained by text.format exactly as chat's response_format is,
so a Responses request and the equivalent chat request generate the same tokens. Nothing is stored
(store is always false in the response; previous_response_id is refused). The stream is in
serve/responses_stream.py.
"""

from __future__ import annotations

import dataclasses
import uuid

from fastapi import Request

from deepinfer.serve.chat_options import TemplateOptions, with_thinking_budget
from deepinfer.serve.checks import (
    check_room,
    check_sampling,
    resolve_max_tokens,
    token_ids,
)
from deepinfer.serve.errors import APIError, bad_request
from deepinfer.serve.prologue import generation_request
from deepinfer.serve.responses_format import (
    finished,
    output_items,
    reasoning_tokens,
    response_shell,
    response_usage,
)
from deepinfer.serve.responses_protocol import (
    ResponsesRequest,
    chat_messages,
    check_honourable,
    sampling_request,
    template_kwargs,
    text_format_spec,
)
from deepinfer.serve.responses_stream import stream_response
from deepinfer.serve.server_state import ServerState, encode, render_chat
from deepinfer.serve.streaming import cached_tokens, collect, event_stream, sequences
from deepinfer.serve.structured import compile_grammar
from deepinfer.text.reasoning import THINK_END, opens_reasoning

FORMAT_FIELD = "text.format"  # the field errors about the output constraint name


async def responses(request: Request):
    state: ServerState = request.app.state.deepinfer
    rid = f"resp_{uuid.uuid4().hex}"
    req, arrival = await generation_request(request, ResponsesRequest, rid)
    check_honourable(req)
    messages = chat_messages(req)
    try:
        text = render_chat(state, messages, True, options=TemplateOptions(kwargs=template_kwargs(req)))
    except APIError as e:  # the chat path names its field "messages"; here the conversation came in "input"
        if e.param and e.param.startswith("messages"):
            e.param = "input"
        raise
    thinking = opens_reasoning(text)  # reasoning.effort opened DeepSeek's <think> block
    prompt = encode(state, text, "input", False)
    token_ids(prompt, "input", state.vocab_size)
    max_tokens = resolve_max_tokens(state.max_model_len, len(prompt), req.max_output_tokens, "max_output_tokens",
                                    "input")
    sp = sampling_request(req, messages).sampling_params(max_tokens, None)
    spec = text_format_spec(req)
    if spec is not None and thinking:  # the format applies to the answer, after the reasoning
        spec = dataclasses.replace(spec, reasoning_end=THINK_END)
    if spec is not None:
        try:
            sp = dataclasses.replace(sp, structured_outputs=spec)
        except ValueError as e:
            raise bad_request(f"{FORMAT_FIELD}: {e}", FORMAT_FIELD) from None
    end_ids = encode(state, THINK_END, "input", False) if thinking else []
    sp = with_thinking_budget(state, sp, req.thinking_token_budget, thinking, "reasoning.effort other than none")
    check_sampling(state, sp)
    grammar = await compile_grammar(state, sp.structured_outputs, FORMAT_FIELD)
    seqs = sequences(rid, [prompt], [sp], [grammar])
    check_room(state, len(seqs), "input")
    shell = response_shell(state, rid, req, sp)
    if req.stream:
        return event_stream(rid, stream_response(state, seqs, arrival, shell, thinking, end_ids))
    c = (await collect(state, rid, seqs, arrival, request))[0]
    n_reasoning = reasoning_tokens(c.token_ids, end_ids) if thinking else 0
    return finished(shell, output_items(rid, c.text, c.finish_reason, thinking),
                    response_usage(len(prompt), len(c.token_ids), cached_tokens(seqs), n_reasoning), c.finish_reason)
