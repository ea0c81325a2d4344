"""POST /v1/responses (OpenAI's Responses API) through the real server on the bundled model, driven by
the official openai client: the same greedy text as the equivalent chat completion, usage, the
incomplete status when max_output_tokens cuts the answer, the stream's events in order, text.format
json_schema, and 400s naming the field for what the server cannot honour.

Every response body and stream event is also validated strictly against the openai package's types
(the client itself builds them without validation, so a missing field would go unnoticed)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

QUESTION = "Tell me about Python lists."


@pytest.fixture(scope="module")
def server(bundled_server):
    """The bundled model's server as the README runs it (conftest.bundled_server, shared)."""
    return bundled_server


@pytest.fixture(scope="module")
def client(bundled_client):
    return bundled_client


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.base + "/v1/models", timeout=30).json()["data"][0]["id"]


def strict(obj):
    """obj re-validated by its own openai type (required fields, literals)."""
    return type(obj).model_validate(obj.to_dict())


def chat_text(client, model, messages, max_tokens):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def test_text_input_answers_as_chat_does(client, model):
    r = strict(client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0))
    text, reason, usage = chat_text(client, model, [{"role": "user", "content": QUESTION}], 8)
    assert r.output_text == text and text
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    msg = r.output[0]
    assert len(r.output) == 1 and msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 8 and r.temperature == 0 and r.tools == [] and r.store is False
    assert reason == "length"  # the bundled model says more than 8 tokens here
    assert r.status == msg.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_messages_with_instructions_answer_as_chat_with_a_system_message(client, model):
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
               {"role": "user", "content": "What is a dict?"}]
    r = strict(client.responses.create(model=model, input=history, instructions="Answer in one short line.",
                                       max_output_tokens=12, temperature=0))
    text, reason, usage = chat_text(client, model, [
        {"role": "system", "content": "Answer in one short line."}, {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is a dict?"}], 12)
    assert r.output_text == text and r.instructions == "Answer in one short line."
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.status == ("incomplete" if reason == "length" else "completed")


EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
END = ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]


def test_stream_events_in_order(client, model):
    whole = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0)
    events = [strict(e) for e in client.responses.create(model=model, input=QUESTION, max_output_tokens=8,
                                                         temperature=0, stream=True)]
    kinds = [e.type for e in events]
    n_deltas = len(kinds) - len(EVENTS) - len(END)
    assert n_deltas >= 1 and kinds == EVENTS + ["response.output_text.delta"] * n_deltas + END, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-3].part.text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.status == whole.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)


def test_text_format_json_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    r = strict(client.responses.create(
        model=model, input="Name a city.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}))
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("extra, field", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"thinking_token_budget": 4}, "thinking_token_budget"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_name_the_field(server, model, extra, field):
    r = httpx.post(server.base + "/v1/responses", json={"model": model, "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert field in err["message"] and (err["param"] or "").startswith(field.split(".")[0]), err


def test_client_raises_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


def test_strict_response_shape(server, model):
    """The raw body passes the openai Response type with validation (not the client's lenient build)."""
    body = httpx.post(server.base + "/v1/responses", timeout=60,
                      json={"model": model, "input": QUESTION, "max_output_tokens": 2, "temperature": 0}).json()
    r = Response.model_validate(body)
    assert r.usage.input_tokens_details.cached_tokens >= 0 and len(r.output_text) > 0


def test_reasoning_effort_returns_a_reasoning_item(server, client, model):
    """reasoning.effort turns DeepSeek's thinking on: the reasoning comes back as a reasoning item (the
    chat path's reasoning_content), the answer as the message after it; streamed, the reasoning_text
    events come first and the whole equals the non-streamed response."""
    kw = dict(model=model, input=QUESTION, max_output_tokens=12, temperature=0.8, reasoning={"effort": "low"},
              extra_body={"seed": 4, "thinking_token_budget": 3})
    r = strict(client.responses.create(**kw))
    chat = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0.8,
        "seed": 4, "reasoning_effort": "low", "thinking_token_budget": 3}).json()["choices"][0]["message"]
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"] and r.output[0].summary == []
    assert r.output[0].content[0].text == chat["reasoning_content"] and r.output_text == chat["content"]
    assert r.usage.output_tokens_details.reasoning_tokens == 3 and r.reasoning.effort == "low"
    events = [strict(e) for e in client.responses.create(**kw, stream=True)]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (chat["reasoning_content"], chat["content"])
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.content_part.added")
    final = events[-1].response
    assert [i.type for i in final.output] == kinds and final.usage.output_tokens == r.usage.output_tokens
    # no budget: the bundled model never closes its reasoning; the output is the reasoning item alone
    open_ended = strict(client.responses.create(model=model, input=QUESTION, max_output_tokens=6, temperature=0.8,
                                                reasoning={"effort": "high"}, extra_body={"seed": 4}))
    assert [i.type for i in open_ended.output] == ["reasoning"] and open_ended.output[0].status == "incomplete"
    assert open_ended.usage.output_tokens_details.reasoning_tokens == open_ended.usage.output_tokens
    err = httpx.post(server.base + "/v1/responses", timeout=30, json={
        "model": model, "input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}).json()["error"]
    assert err["param"] == "reasoning.summary" and "no summaries are written" in err["message"]
