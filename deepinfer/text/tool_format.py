"""DeepSeek-V4's tool-call text format (DSML): the tools' description in the prompt, assistant
tool calls and tool results rendered back into it, and tool calls parsed out of an output,
whole or as it streams.

A call block, as the model writes it (and xgrammar's ``deepseek_v4`` structural tag constrains it):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string argument is written as it is (string="true"); any other value as JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

DSML = "｜DSML｜"
CALLS_BEGIN = f"\n\n<{DSML}tool_calls>\n"
CALLS_END = f"</{DSML}tool_calls>"
TRIGGER = f"<{DSML}tool_calls>"
# whitespace between the tags is the model's (the grammar allows a little), so it is not matched exactly
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>\s*', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def tools_prompt(tools: list[dict]) -> str:
    """The tools section of the prompt: how to call, then each function's JSON description."""
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "## Tools\n\nYou can call these functions. To call one or more, end your reply with:\n"
        f"<{DSML}tool_calls>\n<{DSML}invoke name=\"NAME\">\n"
        f"<{DSML}parameter name=\"ARGUMENT\" string=\"true|false\">VALUE</{DSML}parameter>\n"
        f"</{DSML}invoke>\n</{DSML}tool_calls>\n"
        "(string=\"true\": VALUE is the string itself; otherwise VALUE is JSON.)\n\n"
        f"### Functions\n{schemas}\n\n"
    )


def render_tool_calls(calls: list[dict]) -> str:
    """An assistant message's OpenAI ``tool_calls`` as the model writes them."""
    out = [CALLS_BEGIN]
    for call in calls:
        fn = call["function"]
        args = fn.get("arguments") or "{}"
        args = json.loads(args) if isinstance(args, str) else args
        out.append(f'<{DSML}invoke name="{fn["name"]}">\n')
        for key, value in args.items():
            if isinstance(value, str):
                out.append(f'<{DSML}parameter name="{key}" string="true">{value}</{DSML}parameter>\n')
            else:
                out.append(f'<{DSML}parameter name="{key}" string="false">'
                           f'{json.dumps(value, ensure_ascii=False)}</{DSML}parameter>\n')
        out.append(f"</{DSML}invoke>\n")
    out.append(CALLS_END)
    return "".join(out)


def render_tool_results(contents: list[str]) -> str:
    """Consecutive tool messages, as one user turn."""
    return "<function_results>" + "".join(f"\n<result>{c}</result>" for c in contents) + "\n</function_results>"


def _call(name: str, body: str) -> ToolCall:
    args = {}
    for key, is_string, value in _PARAM.findall(body):
        args[key] = value if is_string == "true" else json.loads(value)
    return ToolCall(name, json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls or None, calls) of a whole output; text without a call block
    is all content."""
    at = text.find(TRIGGER)
    if at < 0:
        return text, []
    content = text[:at].rstrip("\n") or None
    calls = [_call(name, body) for name, body in _INVOKE.findall(text[at:])]
    return content, calls


class ToolCallStream:
    """Incremental parse of a streamed output: ``feed(new text)`` -> (content to send now, calls
    completed now). Text that may be the start of a call block is held back until it is known."""

    def __init__(self):
        self.buffer = ""
        self.in_calls = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        if not self.in_calls:
            at = self.buffer.find(TRIGGER)
            if at < 0:
                keep = _partial_suffix(self.buffer, "\n\n" + TRIGGER)
                content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return content, []
            content, self.buffer = self.buffer[:at].rstrip("\n"), self.buffer[at:]
            self.in_calls = True
        else:
            content = ""
        calls = []
        while True:
            m = _INVOKE.search(self.buffer)
            if m is None:
                break
            calls.append(_call(m.group(1), m.group(2)))
            self.buffer = self.buffer[m.end():]
        self.num_calls += len(calls)
        return content, calls

    def flush(self) -> str:
        """At the end: held-back text that never became a call block is content after all."""
        rest, self.buffer = ("" if self.in_calls else self.buffer), ""
        return rest


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a beginning of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
