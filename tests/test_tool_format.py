"""DeepSeek-V4's tool-call text (text/tool_format.py): calls rendered into a prompt parse back to
the same calls, and the streaming parser gives what the whole-output parser gives, however the
text is cut."""

from __future__ import annotations

import json

from deepinfer.text.tool_format import (
    CALLS_BEGIN,
    ToolCallStream,
    parse_tool_calls,
    render_tool_calls,
    render_tool_results,
    tools_prompt,
)

CALLS = [
    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
    {"id": "b", "type": "function", "function": {"name": "search", "arguments": json.dumps(
        {"q": "naïve <b>", "filters": {"lang": ["en", "fr"]}, "exact": False, "n": None})}},
]


def test_rendered_calls_parse_back():
    text = "Let me check." + render_tool_calls(CALLS)
    assert text.startswith("Let me check." + CALLS_BEGIN) and text.endswith("</｜DSML｜tool_calls>")
    assert '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>' in text
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_streamed_parse_equals_the_whole_parse_at_every_cut():
    text = "Sure:" + render_tool_calls(CALLS)
    want_content, want = parse_tool_calls(text)
    for step in (1, 3, 7, len(text)):
        stream, content, calls = ToolCallStream(), "", []
        for i in range(0, len(text), step):
            piece, done = stream.feed(text[i : i + step])
            content += piece
            calls += done
        content += stream.flush()
        assert content == want_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


def test_text_that_only_looks_like_a_call_start_is_content():
    stream = ToolCallStream()
    held, _ = stream.feed("a\n\n<｜DS")
    assert held == "a"  # the rest may open a call block: held back
    more, calls = stream.feed("ML is not a call")
    assert calls == [] and held + more + stream.flush() == "a\n\n<｜DSML is not a call"


def test_prompt_parts():
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    prompt = tools_prompt(tools)
    assert '{"name": "f", "description": "d", "parameters": {"type": "object"}}' in prompt
    assert render_tool_results(["x", "y"]) == "<function_results>\n<result>x</result>\n<result>y</result>\n</function_results>"
