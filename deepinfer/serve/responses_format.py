"""The response objects of ``POST /v1/responses`` in the shapes of the openai package's
``openai.types.responses`` (Response, ResponseOutputMessage, ResponseOutputText, ResponseUsage)."""

from __future__ import annotations

import time

from deepinfer.serve.responses_protocol import ResponsesRequest, text_echo
from deepinfer.text.reasoning import split_reasoning


def response_shell(state, rid: str, req: ResponsesRequest, sp) -> dict:
    """The response object before anything is generated (status in_progress, no output): what the
    stream's first events carry, and what the final response fills in."""
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": state.model_name,
        "output": [], "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
        "service_tier": "default", "store": False, "temperature": sp.temperature, "top_p": sp.top_p,
        "text": text_echo(req), "tool_choice": req.tool_choice or "auto", "tools": [], "top_logprobs": 0,
        "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {},
    }


def message_id(rid: str) -> str:
    """The id of a response's (one) output message: msg_ and the response id's hex."""
    return "msg_" + rid.removeprefix("resp_")


def reasoning_id(rid: str) -> str:
    return "rs_" + rid.removeprefix("resp_")


def reasoning_item(item_id: str, text: str, ended: bool) -> dict:
    """DeepSeek's reasoning as the API's reasoning item: its text as reasoning_text content, no summary."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed" if ended else "incomplete",
            "content": [{"type": "reasoning_text", "text": text}]}


def output_message(item_id: str, text: str, finish_reason: str | None) -> dict:
    """The assistant message: one output_text part; incomplete when cut by the token limit."""
    status = "incomplete" if finish_reason == "length" else "completed"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def response_usage(input_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int = 0) -> dict:
    # cache_write_tokens (required by the openai types) is for caches billed on write: none here
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def reasoning_tokens(token_ids: list[int], end_ids: list[int]) -> int:
    """Output tokens before the reasoning's end marker (all of them when it never ended)."""
    k = len(end_ids)
    for i in range(len(token_ids) - k + 1):
        if token_ids[i:i + k] == end_ids:
            return i
    return len(token_ids)


def output_items(rid: str, text: str, finish_reason: str | None, thinking: bool) -> list[dict]:
    """The output: with thinking, the reasoning item, then the message when the reasoning ended."""
    if not thinking:
        return [output_message(message_id(rid), text, finish_reason)]
    reasoning, content = split_reasoning(text)
    items = [reasoning_item(reasoning_id(rid), reasoning, content is not None)]
    if content is not None:
        items.append(output_message(message_id(rid), content, finish_reason))
    return items


def finished(shell: dict, output: list[dict], usage: dict, finish_reason: str | None) -> dict:
    """The final response: completed, or incomplete when the output hit max_output_tokens (or the
    context length, which OpenAI reports the same way)."""
    cut = finish_reason == "length"
    return {**shell, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output, "usage": usage}
