"""The model served when none is named: deepinfer-tiny-v4, trained and shipped inside the package.

A small DeepSeek-V4 (every layer type, hash and score MoE, hyper-connections, an
MTP block) with a byte-level BPE tokenizer and DeepSeek's chat template, trained by
``python -m scripts.tiny_model`` on text that ships with Python and PyPI packages
(its TRAINING.md has the report). It lives in ``deepinfer/assets/`` in Hugging Face
layout, so the server and ``LLM()`` answer out of the box with no download.
"""

from __future__ import annotations

import json
import os

NAME = "deepinfer-tiny-v4"

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT)

# DeepSeek's chat layout: BOS, system text, then <｜User｜>...<｜Assistant｜>... turns. Tools (DeepSeek-V4's
# DSML format, deepinfer/text/tool_format.py) arrive pre-rendered: ``tools_prompt`` after BOS, an
# assistant turn's ``tool_calls_text`` after its content, tool results as a user turn (role "tool").
# Thinking (``thinking`` true, vLLM's chat_template_kwargs): the generation prompt opens DeepSeek's
# reasoning block with <think>; past turns keep only their answers (DeepSeek drops old reasoning).
CHAT_TEMPLATE = (
    "{{ bos_token }}{{ tools_prompt or '' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'tool' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + (message['tool_calls_text'] or '') + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- if thinking %}{{ '<think>' }}{%- endif %}{%- endif %}"
)


def default_model_dir() -> str:
    """The bundled model's folder (config.json, model.safetensors, tokenizer files)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", NAME)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(
            f"the bundled model is missing from {path} (a checkout without its assets?); "
            "pass --model DIR, or rebuild it with `python -m scripts.tiny_model --out " + path + "`"
        )
    return path


def write_tokenizer_files(tok, directory: str, max_len: int) -> None:
    """tokenizer.json (a ``tokenizers.Tokenizer``) and tokenizer_config.json with DeepSeek's
    special tokens and chat template: what TextTokenizer and transformers' AutoTokenizer read."""
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
             "model_max_length": max_len, "tokenizer_class": "PreTrainedTokenizerFast"},
            f, indent=2, ensure_ascii=False,
        )


def cache_root() -> str:
    """deepinfer's cache folder (compiled programs, test models): $DEEPINFER_CACHE, else ~/.cache/deepinfer."""
    return os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
