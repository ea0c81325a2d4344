"""DeepSeek's thinking mode through the real server on the bundled model (conftest.bundled_server):
the template's switch (chat_template_kwargs, reasoning_effort), reasoning_content apart from
content (streamed and not), vLLM's thinking_token_budget forcing the end marker, a JSON schema
and tool calls applied after the reasoning, past reasoning dropped from the prompt.

The bundled model was never trained to think, so it does not close its reasoning by itself:
the budget is what ends it here (its own test: tests/test_surface_units.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer.default_model import default_model_dir
from deepinfer.text.tokenizer import TextTokenizer
from tests.test_server_extras import error, post, stream

pytest.importorskip("xgrammar")

ASK = [{"role": "user", "content": "What is a list?"}]
THINK = {"chat_template_kwargs": {"thinking": True}}
SCHEMA = {"type": "object", "properties": {"size": {"type": "integer"}}, "required": ["size"]}


def _deltas(chunks) -> tuple[str, str]:
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return reasoning, content


def test_thinking_opens_the_reasoning_and_the_budget_ends_it(bundled_server):
    srv = bundled_server
    tok = TextTokenizer.from_dir(default_model_dir())
    body = {"messages": ASK, "max_tokens": 24, "temperature": 0, "min_tokens": 10, "thinking_token_budget": 4, **THINK,
            "logprobs": True}
    got = post(srv, "/v1/chat/completions", body)
    message = got["choices"][0]["message"]
    ids = [int(e["token"].split(":")[1]) for e in
           post(srv, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]["content"]]
    marker = tok.encode("</think>", add_special_tokens=False)
    assert ids[4:4 + len(marker)] == marker  # forced right after the 4 reasoning tokens
    assert message["reasoning_content"] == tok.decode(ids[:4]) and message["content"] == tok.decode(ids[4 + len(marker):])
    assert message["content"]  # the answer goes on after the reasoning
    assert _deltas(stream(srv, "/v1/chat/completions", body)) == (message["reasoning_content"], message["content"])
    # the prompt ends with the template's <think>; without thinking it does not, and nothing is split
    assert got["usage"]["prompt_tokens"] == post(srv, "/tokenize", {"messages": ASK})["count"] + len(
        tok.encode("<think>", add_special_tokens=False))
    off = post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": 6, "temperature": 0})["choices"][0]["message"]
    assert "reasoning_content" not in off


def test_reasoning_effort_switches_thinking(bundled_server):
    srv = bundled_server
    base = {"messages": ASK, "max_tokens": 12, "seed": 5, "thinking_token_budget": 3}
    low = post(srv, "/v1/chat/completions", {**base, "reasoning_effort": "low"})["choices"][0]["message"]
    kw = post(srv, "/v1/chat/completions", {**base, **THINK})["choices"][0]["message"]
    assert low == kw and low["reasoning_content"] is not None
    assert error(srv, "/v1/chat/completions", {**base, "reasoning_effort": "none"}) == (
        "thinking_token_budget needs thinking on (chat_template_kwargs {\"thinking\": true} or reasoning_effort) "
        "and a template that opens the reasoning", "thinking_token_budget")
    assert error(srv, "/v1/chat/completions", {**base, "reasoning_effort": "high",
                                                "chat_template_kwargs": {"thinking": False}})[1] == "reasoning_effort"
    assert error(srv, "/v1/chat/completions", {**base, "chat_template_kwargs": {"messages": []}}) == (
        "chat_template_kwargs may not set messages (the server sets them)", "chat_template_kwargs")


def test_a_json_schema_applies_after_the_reasoning(bundled_server):
    srv = bundled_server
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "thinking_token_budget": 4, **THINK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
    message = post(srv, "/v1/chat/completions", body)["choices"][0]["message"]
    assert message["reasoning_content"]  # free text, not JSON
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert _deltas(stream(srv, "/v1/chat/completions", body)) == (message["reasoning_content"], message["content"])


def test_tool_calls_come_after_the_reasoning(bundled_server):
    srv = bundled_server
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}}}
    body = {"messages": ASK, "max_tokens": 400, "temperature": 0, "thinking_token_budget": 3, **THINK,
            "tools": [tool], "tool_choice": "required"}
    got = post(srv, "/v1/chat/completions", body)["choices"][0]
    assert got["message"]["reasoning_content"] and "DSML" not in got["message"]["reasoning_content"]
    calls = got["message"]["tool_calls"]
    assert got["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["lookup"]
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"word"}


def test_past_reasoning_is_dropped_from_the_prompt(bundled_server):
    srv = bundled_server
    turns = [*ASK, {"role": "assistant", "content": "A sequence."}, {"role": "user", "content": "And a tuple?"}]
    with_reasoning = [*ASK, {"role": "assistant", "content": "A sequence.", "reasoning_content": "long thoughts " * 20},
                      turns[2]]
    a = post(srv, "/v1/chat/completions", {"messages": turns, "max_tokens": 4, "temperature": 0})
    b = post(srv, "/v1/chat/completions", {"messages": with_reasoning, "max_tokens": 4, "temperature": 0})
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] and a["choices"] == b["choices"]
