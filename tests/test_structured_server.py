"""Structured outputs through the real server on the bundled model, driven by the openai client:
``parse()`` with a pydantic model, response_format json_schema / json_object, vLLM's
structured_outputs and guided_* fields (streaming and not), n > 1, and bad constraints as
400s that leave the server serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar")

MODEL = "deepinfer-tiny-v4"


@pytest.fixture(scope="module")
def server(bundled_server):
    """The bundled model's server as the README runs it (conftest.bundled_server, shared)."""
    return bundled_server


@pytest.fixture(scope="module")
def client(bundled_client):
    return bundled_client


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


def _chat(content="Describe someone, please."):
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=_chat(), response_format=Person, max_tokens=120,
                                      temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(r.choices[0].message.content) == person


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=_chat(), response_format=fmt, max_tokens=120, n=2,
                                       temperature=0.9, seed=4)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=_chat("hi"), response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_fields_on_completions_streaming_and_not(client):
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=30, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["left", "right", "straight on"]}})
    assert "".join(c.choices[0].text for c in chunks) in ("left", "right", "straight on")
    stream = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=120, temperature=0, stream=True,
                                            extra_body={"guided_json": Person.model_json_schema()})
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    r = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=40, temperature=0,
                                       extra_body={"guided_grammar": 'root ::= "(" [0-9]+ ")"'})
    assert re.fullmatch(r"\([0-9]+\)", r.choices[0].message.content)


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "(a"}, "invalid regex constraint: Regex parsing error at position 3"),
    ({"guided_json": {"type": "string", "format": "iri"}}, "'format': 'iri' at #"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "'uniqueItems' (unique array items) at #"),
    ({"guided_grammar": "root ::= nothing"}, 'Rule "nothing" is not defined'),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "send one output constraint, got guided_regex, guided_choice"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs: unknown keys ['jsn']"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be 'text', 'json_object', 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format json_schema needs"),
    ({"guided_regex": "a", "ignore_eos": True}, "cannot be combined with ignore_eos"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend must be 'xgrammar'"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, client, body, message):
    r = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    # the server goes on serving
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                   extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", ok.choices[0].text)


def test_a_constraint_cut_by_max_tokens_ends_with_length_and_metrics_move(server, client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0,
                                  extra_body={"guided_regex": "[0-9]{50}"})
    assert r.choices[0].finish_reason == "length" and re.fullmatch("[0-9]+", r.choices[0].text)
    text = httpx.get(server.base + "/metrics", timeout=30).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values['deepinfer:grammar_compile_seconds_count{model_name="deepinfer-tiny-v4"}'] >= 5
    assert values['deepinfer:grammar_cache_hits_total{model_name="deepinfer-tiny-v4"}'] >= 1
    assert values['deepinfer:grammar_mask_fill_seconds_count{model_name="deepinfer-tiny-v4"}'] > 10


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, stream):
    msgs = _chat("What is the weather in Paris?")
    for choice, names in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])):
        kw = dict(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=500, temperature=0)
        if not stream:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "tool_calls"
            _check_calls(r.choices[0].message.tool_calls, names)
            continue
        calls, reasons = [], []
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            calls += delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "tool_calls" and [c.index for c in calls] == list(range(len(calls)))
        _check_calls(calls, names)


def test_tool_results_render_back_into_the_prompt(server, client):
    r = client.chat.completions.create(model=MODEL, messages=_chat("Weather?"), tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=500, temperature=0)
    (call,) = r.choices[0].message.tool_calls  # parallel_tool_calls=False: one call
    msgs = _chat("Weather?") + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    follow = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length")
    ids = httpx.post(server.base + "/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert f'<｜DSML｜invoke name="{call.function.name}">' in text
    assert "<｜User｜><function_results>\n<result>sunny, 21C</result>\n</function_results><｜Assistant｜>" in text


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope', which is not in tools (get_weather, get_time)"),
    ({"tool_choice": "required", "tools": None}, "tool_choice 'required' needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "send one output constraint: tools (tool_choice) and response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "String should match pattern"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]},
     "messages[0].tool_calls: each needs function.name and function.arguments"),
])
def test_bad_tool_requests_are_400s(server, body, message):
    req = {"model": MODEL, "messages": _chat(), "tools": TOOLS, "max_tokens": 4, **body}
    r = httpx.post(server.base + "/v1/chat/completions", json={k: v for k, v in req.items() if v is not None},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def _fake_state(timeout_s=30.0):
    """What compile_grammar and plan_tools read from a ServerState, without a server."""
    from types import SimpleNamespace

    from deepinfer.default_model import default_model_dir
    from deepinfer.grammar.backend import GrammarBackend
    from deepinfer.serve.metrics import ServerMetrics

    backend = GrammarBackend(default_model_dir(), 4096, (1,), compile_timeout_s=timeout_s)
    return SimpleNamespace(grammar=backend, metrics=ServerMetrics(MODEL))


def test_a_compile_over_the_time_limit_is_a_400():
    import asyncio

    from deepinfer.grammar.spec import StructuredOutputsParams
    from deepinfer.serve.errors import APIError
    from deepinfer.serve.structured import compile_grammar

    state = _fake_state(timeout_s=1e-6)
    state.grammar.compile(StructuredOutputsParams(regex="warm"), timeout_s=60)  # xgrammar loaded: only the compile is timed
    slow = StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{1,9}$"}
                                                                         for i in range(100)}})
    with pytest.raises(APIError) as err:
        asyncio.run(compile_grammar(state, slow, "guided_json"))
    assert err.value.status == 400 and err.value.param == "guided_json"
    assert "compiling the json constraint took longer than 1e-06 s" in err.value.message


def test_tool_choice_auto_constrains_a_call_block_once_begun():
    from deepinfer.serve.protocol import ChatCompletionRequest
    from deepinfer.serve.tools import plan_tools

    state = _fake_state()
    req = ChatCompletionRequest(model=MODEL, messages=_chat(), tools=TOOLS)
    plan = plan_tools(state, req)
    assert plan.parse and "## Tools" in plan.prompt and '"name": "get_weather"' in plan.prompt
    compiled = state.grammar.compile(plan.spec)

    def accepts(text):
        return state.grammar.matcher(compiled).accept_string(text)

    call = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">\n'
            '<｜DSML｜parameter name="zone" string="true">UTC</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    assert accepts("Just text, no call.") and accepts("Let me look." + call)
    assert not accepts('Let me look.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_news">')  # not a tool
    assert not accepts(call.replace(">UTC<", ">PST<"))  # not in the argument's enum
    none = plan_tools(state, ChatCompletionRequest(model=MODEL, messages=_chat(), tools=TOOLS, tool_choice="none"))
    assert (none.prompt, none.spec, none.parse) == ("", None, False)  # tools left out, text out
