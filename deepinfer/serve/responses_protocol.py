"""The request of OpenAI's Responses API (``POST /v1/responses``) and its translation to what the
chat path already takes: ChatMessage objects, a ChatCompletionRequest for the sampling defaults, and
the text.format constraint as a StructuredOutputsParams.

Fields of the API that change nothing here are accepted (their values are echoed in the response);
fields deepinfer cannot honour are refused by name with the reason (``check_honourable``), so a client
never gets an answer that silently ignored what it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictStr, Tag

from deepinfer.grammar.spec import StructuredOutputsParams
from deepinfer.serve.errors import bad_request
from deepinfer.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    _Strict,
)


def _text_or(other: str):
    """A field that is a string or ``other``: errors name the branch the value took (``input.messages.0.role``),
    not both branches' failures under pydantic's type names."""
    return Discriminator(lambda v: "text" if isinstance(v, str) else other)


class InputText(_Strict):
    # output_text parts are an earlier answer sent back as history; they carry annotations (and logprobs)
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[Annotated[StrictStr, Tag("text")] | Annotated[list[InputText], Tag("parts")],
                       _text_or("parts")]
    # an output message of an earlier response, sent back as history, carries its id and status
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class Reasoning(_Strict):
    # anything but "none" turns DeepSeek's thinking on (as chat's reasoning_effort); the reasoning text
    # comes back as a reasoning item (no summaries are written)
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Annotated[Annotated[StrictStr, Tag("text")] | Annotated[list[InputMessage], Tag("messages")],
                     _text_or("messages")]
    instructions: StrictStr | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    text: TextConfig | None = None
    # accepted where they change nothing (check_honourable refuses the rest)
    store: bool | None = None  # nothing is stored either way; the response says store: false
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    thinking_token_budget: int | None = None  # vLLM's extra, as on chat: at most N reasoning tokens, then </think>
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None


def check_honourable(req: ResponsesRequest) -> None:
    """400 naming the first field set to something this server cannot do, and why."""
    refused = [
        ("previous_response_id", req.previous_response_id is not None,
         "this server stores no responses; send the whole conversation in input"),
        ("tools", bool(req.tools), "tools are not supported on /v1/responses; use /v1/chat/completions"),
        ("tool_choice", req.tool_choice not in (None, "none", "auto"), "there are no tools to choose from"),
        ("service_tier", req.service_tier not in (None, "auto", "default"), "there is one tier: default"),
        ("reasoning.summary", req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary)
         is not None, "no summaries are written: the reasoning text itself comes back as a reasoning item"),
        ("truncation", req.truncation == "auto",
         "input is never truncated to fit; send a shorter one (or truncation: disabled)"),
        ("include", bool(req.include), "no extra output can be included"),
        ("top_logprobs", bool(req.top_logprobs), "log-probabilities are not supported on /v1/responses"),
    ]
    for field, bad, why in refused:
        if bad:
            raise bad_request(f"unsupported {field}: {why}", field)


def chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The conversation as chat messages: the instructions as a system message first, then the input;
    input_text and output_text parts become plain text parts."""
    if not req.input:
        raise bad_request("input is empty; send a string or a list of messages", "input")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    if isinstance(req.input, str):
        return messages + [ChatMessage(role="user", content=req.input)]
    for item in req.input:
        content = item.content if isinstance(item.content, str) else [
            ContentPart(type="text", text=part.text) for part in item.content]
        messages.append(ChatMessage(role=item.role, content=content))
    return messages


def sampling_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The equivalent chat request: the Responses API samples exactly as chat does by default."""
    return ChatCompletionRequest(messages=messages, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                 user=req.user)


def template_kwargs(req: ResponsesRequest) -> dict:
    """The chat template's thinking switch from reasoning.effort (serve/chat_options.py's meaning)."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    return {} if effort is None else {"thinking": effort != "none", "reasoning_effort": effort}


def text_format_spec(req: ResponsesRequest) -> StructuredOutputsParams | None:
    """text.format as an output constraint (None: free text)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is missing: type json_schema needs a JSON schema object",
                          "text.format.schema")
    try:
        return StructuredOutputsParams(json=fmt.schema_)
    except ValueError as exc:
        raise bad_request(f"text.format.schema: {exc}", "text.format.schema") from None


def text_echo(req: ResponsesRequest) -> dict:
    """The response's ``text`` field: the format that was applied."""
    fmt = req.text.format if req.text is not None else None
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}
