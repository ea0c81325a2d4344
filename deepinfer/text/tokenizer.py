"""A checkpoint's tokenizer: tokenizer.json (the `tokenizers` library) plus tokenizer_config.json
(special tokens, chat template). The chat template is Jinja, rendered in a sandbox the way
transformers renders it, with ``messages``, ``add_generation_prompt``, ``bos_token`` and
``eos_token`` in scope."""

from __future__ import annotations

import json
import os
from typing import Any


class ChatTemplateError(ValueError):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} spelling
        return value.get("content")
    return value


class TextTokenizer:
    def __init__(self, tokenizer, config: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        config = config or {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = config.get("chat_template")
        self._template = None

    @classmethod
    def from_dir(cls, directory: str) -> "TextTokenizer | None":
        """The tokenizer of a checkpoint folder, or None when it has no tokenizer.json."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer

        config = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(Tokenizer.from_file(path), config)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. Special tokens written in the text are recognised as such;
        ``add_special_tokens`` prepends BOS when the config asks for it."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools_prompt: str = "", chat_template: str | None = None, **template_kwargs: Any) -> str:
        """The prompt text for a conversation. Message content may be a string or a list of
        ``{"type": "text", "text": ...}`` parts (joined). ``tools_prompt``: the tools section,
        rendered (text/tool_format.py); templates that know it place it. ``chat_template``: a
        template to use instead of the model's; ``template_kwargs``: more template variables
        (vLLM's chat_template_kwargs, e.g. ``thinking=True``)."""
        if chat_template is not None:
            template = _compile(chat_template)
        else:
            if self.chat_template is None:
                raise ChatTemplateError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
            if self._template is None:
                self._template = _compile(self.chat_template)
            template = self._template
        flat = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
        try:
            return template.render(
                **template_kwargs, messages=flat, add_generation_prompt=add_generation_prompt, tools_prompt=tools_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own error (sandbox, undefined call, ...)
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def _compile(source: str):
    """A template in the sandbox transformers renders chat templates in."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {exc}") from None


def flatten_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def _raise(message: str):
    raise ChatTemplateError(message)
