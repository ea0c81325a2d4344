"""The server's state (model, tokenizer, engine, limits) and the helpers that read requests
against it: model names, text encoding, completion prompts, chat rendering."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.serve.async_engine import AsyncEngine
from deepinfer.serve.checks import at_most, check_text, token_ids
from deepinfer.serve.errors import APIError, bad_request
from deepinfer.serve.formatting import TokenText
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.text.tokenizer import ChatTemplateError, TextTokenizer, flatten_content
from deepinfer.text.tool_format import render_tool_calls, render_tool_results

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields beyond role / content / name; an assistant turn's reasoning is dropped from the prompt (DeepSeek
# keeps only the answers of past turns)
ALLOWED_EXTRA = {"assistant": {"tool_calls", "reasoning_content", "reasoning"}, "tool": {"tool_call_id"}}


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: TextTokenizer | None
    model_name: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_waiting: int  # sequences allowed to wait beyond max_num_seqs before 503
    metrics: ServerMetrics
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    aliases: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    grammar: Any = None  # grammar/backend.GrammarBackend: structured outputs (None: no tokenizer)
    draining: bool = False  # set on SIGTERM (serve/shutdown.py): new generation requests get 503
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered (sandboxed)
    ui: bool = False  # serve the built-in web page at / (serve/ui_routes.py)

    def __post_init__(self):
        self.text_of = TokenText(self.tokenizer.tokenizer if self.tokenizer else None)


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name and name not in state.aliases:
        raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}", "model")


def encode(state: ServerState, text: str, what: str, add_special_tokens: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise bad_request(f"this model has no tokenizer: send {what} as token ids", what)
    return state.tokenizer.encode(check_text(text, what), add_special_tokens=add_special_tokens)


def completion_prompts(state: ServerState, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
    vocab = state.vocab_size
    if isinstance(prompt, str):
        return [token_ids(encode(state, prompt, "prompt", add_special_tokens), "prompt", vocab)]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [token_ids(list(prompt), "prompt", vocab)]
    # several prompts: each is a sequence, so more than the server can hold can never run
    at_most(prompt, "prompt", state.max_num_seqs + state.max_waiting, "prompts")
    if all(isinstance(p, str) for p in prompt):
        return [token_ids(encode(state, p, f"prompt[{i}]", add_special_tokens), f"prompt[{i}]", vocab)
                for i, p in enumerate(prompt)]
    return [token_ids(list(p), f"prompt[{i}]", vocab) for i, p in enumerate(prompt)]


def render_chat(state: ServerState, messages, add_generation_prompt: bool, tools_prompt: str = "",
                continue_final: bool = False, options=None) -> str:
    """The prompt of a conversation. Assistant ``tool_calls`` and ``tool`` results are written in
    the model's tool format (text/tool_format.py); consecutive tool results make one turn.
    ``continue_final`` (vLLM's continue_final_message): the prompt ends right after the last
    message's content (an assistant turn left open for the model to continue). ``options``: a
    serve/chat_options.TemplateOptions (the request's template and its variables)."""
    if continue_final:
        last = messages[-1]
        if add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if last.role != "assistant" or not flatten_content(last.content if isinstance(last.content, str) or last.content is None
                                                            else [p.model_dump() for p in last.content]):
            raise bad_request("continue_final_message needs a last message from the assistant with content",
                              "continue_final_message")
    plain = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}]: unknown role {m.role!r} (expected one of {', '.join(ROLES)})", f"messages[{i}].role")
        extra = sorted(set(m.model_extra or {}) - ALLOWED_EXTRA.get(m.role, set()))
        if extra:
            raise bad_request(f"messages[{i}]: unsupported field(s) {', '.join(extra)}", f"messages[{i}]")
        content = m.content if isinstance(m.content, str) or m.content is None else [p.model_dump() for p in m.content]
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
        entry = {"role": "system" if m.role == "developer" else m.role, "content": content}
        calls = (m.model_extra or {}).get("tool_calls")
        if m.role == "assistant" and calls:
            entry["tool_calls_text"] = _tool_calls_text(calls, i)
        if m.role == "tool":
            text = flatten_content(content)
            if plain and plain[-1]["role"] == "tool":
                plain[-1]["results"].append(text)
            else:
                plain.append({"role": "tool", "results": [text]})
            continue
        plain.append(entry)
    for entry in plain:
        if entry["role"] == "tool":
            entry["content"] = render_tool_results(entry.pop("results"))
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    try:
        text = state.tokenizer.apply_chat_template(plain, add_generation_prompt, tools_prompt,
                                                   options.chat_template if options else None,
                                                   **(options.kwargs if options else {}))
    except ChatTemplateError as e:
        raise bad_request(str(e), "chat_template" if options and options.chat_template else "messages") from None
    if continue_final:  # cut what the template closes the turn with (EOS, ...)
        final = flatten_content(plain[-1]["content"])
        text = text[: text.rfind(final) + len(final)]
    return text


def _tool_calls_text(calls, i: int) -> str:
    try:
        return render_tool_calls(calls)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise bad_request(f"messages[{i}].tool_calls: each needs function.name and function.arguments "
                          f"(a JSON object as text): {type(exc).__name__}: {exc}", f"messages[{i}].tool_calls") from None
