"""The response objects of ``POST /v1/responses`` in the shapes of the openai package's
``openai.types.responses`` (Response, ResponseOutputMessage, ResponseOutputText, ResponseUsage)."""

from __future__ import annotations

import time

from deepinfer.serve.responses_protocol import ResponsesRequest, text_echo


def response_shell(state, rid: str, req: ResponsesRequest, sp) -> dict:
    """The response object before anything is generated (status in_progress, no output): what the
    stream's first events carry, and what the final response fills in."""
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": state.model_name,
        "output": [], "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": False, "temperature": sp.temperature, "top_p": sp.top_p,
        "text": text_echo(req), "tool_choice": req.tool_choice or "auto", "tools": [], "top_logprobs": 0,
        "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {},
    }


def message_id(rid: str) -> str:
    """The id of a response's (one) output message: msg_ and the response id's hex."""
    return "msg_" + rid.removeprefix("resp_")


def output_message(item_id: str, text: str, finish_reason: str | None) -> dict:
    """The assistant message: one output_text part; incomplete when cut by the token limit."""
    status = "incomplete" if finish_reason == "length" else "completed"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def response_usage(input_tokens: int, output_tokens: int, cached: int) -> dict:
    # cache_write_tokens (required by the openai types) is for caches billed on write: none here
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def finished(shell: dict, message: dict, usage: dict, finish_reason: str | None) -> dict:
    """The final response: completed, or incomplete when the output hit max_output_tokens (or the
    context length, which OpenAI reports the same way)."""
    cut = finish_reason == "length"
    return {**shell, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": [message], "usage": usage}
