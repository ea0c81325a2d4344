"""OpenAI tool calling: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` read into what the
prompt shows and what constrains the output.

``tool_choice``: "none" (tools left out of the prompt, output is text), "auto" (the default
with tools: the model may call; once it starts a call block the block is constrained to the
functions' schemas), "required" (at least one call, constrained from the first token), or
{"type": "function", "function": {"name": ...}} (that function). The constraint is
xgrammar's structural tag for DeepSeek-V4's call format (text/tool_format.py parses it back).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.grammar.backend import StructuredOutputsUnavailable
from deepinfer.grammar.spec import StructuredOutputsParams
from deepinfer.serve.errors import bad_request
from deepinfer.text.tool_format import tools_prompt

MAX_TOOLS = 128


@dataclass
class ToolPlan:
    prompt: str = ""  # the tools section of the prompt ("" when none)
    spec: StructuredOutputsParams | None = None  # the constraint on the output
    parse: bool = False  # read tool calls out of the output


def plan_tools(state, req, reasoning: bool = False) -> ToolPlan:
    """``reasoning``: the prompt opened a thinking block; calls are constrained after it ends."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools may hold at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"tools: function names must be unique, got {names}", "tools")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name is None:
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools ({', '.join(names) or 'none'})",
                              "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          "tool_choice")
    elif choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "none":
        return ToolPlan()
    plain = [t.model_dump(exclude_none=True) for t in tools]
    for t in plain:
        t["function"].setdefault("parameters", {"type": "object", "properties": {}})
    spec = None
    if state.grammar is not None:
        try:
            xgr = state.grammar.xgrammar
        except StructuredOutputsUnavailable as exc:
            if choice != "auto":
                raise bad_request(str(exc), "tool_choice") from None
            xgr = None  # auto without xgrammar: calls are parsed, not constrained
        if xgr is not None:
            try:
                tag = xgr.get_builtin_structural_tag("deepseek_v4", tools=plain, tool_choice=choice,
                                                     reasoning="enabled" if reasoning else "disabled",
                                                     parallel_tool_calls=req.parallel_tool_calls is not False,
                                                     max_whitespace_cnt=1)  # a model must not loop on newlines
            except (ValueError, TypeError) as exc:
                raise bad_request(f"tools: {exc}", "tools") from None
            spec = StructuredOutputsParams(structural_tag=tag.model_dump_json())
    elif choice != "auto":
        raise bad_request("tool_choice 'required' or a named function needs the model's tokenizer", "tool_choice")
    return ToolPlan(tools_prompt(plain), spec, True)
