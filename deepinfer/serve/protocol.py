"""Request models of the OpenAI API (pydantic), and their translation to SamplingParams.

Unknown fields are rejected (a typo is not silently ignored); fields of the
OpenAI API that deepinfer does not implement yet are rejected by name with the
reason, unless they carry their neutral value (e.g. ``presence_penalty: 0``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.serve.errors import bad_request
from deepinfer.serve.structured import structured_spec

# field -> the value that means "off" (accepted), for fields deepinfer does not implement
NOT_YET = {
    "functions": None, "function_call": None, "audio": None, "modalities": None, "prediction": None,
    "web_search_options": None,
}
_REASON: dict[str, str] = {}


def check_not_yet(raw: dict[str, Any]) -> None:
    """400 naming every field that is set to something deepinfer cannot honour yet."""
    bad = []
    for key, neutral in NOT_YET.items():
        if key not in raw or raw[key] is None or raw[key] == neutral:
            continue
        bad.append(key)
    if bad:
        reasons = {_REASON.get(k, "not implemented yet") for k in bad}
        raise bad_request(f"unsupported field(s) {', '.join(bad)}: {'; '.join(sorted(reasons))}", bad[0])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI's fields that change nothing here: deepinfer stores no completions (store, metadata) and
    # has one service tier (answered as "default")
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # output constraints (serve/structured.py reads them into one StructuredOutputsParams)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's extras
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: StrictInt | None = None  # keep the last N prompt tokens (-1: max_model_len)
    priority: StrictInt = 0  # --scheduling-policy priority: lower is scheduled first
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (unambiguous for any bytes)
    # with skip_special_tokens false: true puts a space between special tokens and the text around them
    # (slow tokenizers' convention), false joins them as decoded; unset: as the tokenizer decodes
    spaces_between_special_tokens: bool | None = None
    # prefix caching: requests share cached prompt state only with requests of the same salt (tenants)
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=1024)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: int() would also take " 5", "1_0" and other scripts' digits
            if not (key.isascii() and key.lstrip("-").isdigit() and len(key) <= 10):
                raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
            bias[int(key)] = value
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                min_p=self.min_p or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                logit_bias=bias,
                min_tokens=self.min_tokens or 0,
                prompt_logprobs=self.prompt_logprobs,
                structured_outputs=structured_spec(self),
                include_stop_str_in_output=self.include_stop_str_in_output,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
            )
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


    def truncate(self, prompt: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1: max_model_len)."""
        n = self.truncate_prompt_tokens
        if n is None:
            return prompt
        if n == -1:
            n = max_model_len
        if n < 1:
            raise bad_request(f"truncate_prompt_tokens must be -1 or a positive integer, got {n}", "truncate_prompt_tokens")
        return prompt[-n:]


class CompletionRequest(_Sampling):
    # token ids are strict: true is not token 1
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16  # 0 with echo: score the prompt only (serve/scoring.py)
    logprobs: int | None = None
    echo: bool = False  # the prompt comes back before the completion (with its logprobs when asked)
    suffix: str | None = None  # fill in the middle: needs a tokenizer with FIM tokens (serve/scoring.py)
    best_of: StrictInt | None = None  # sample this many, return the n of highest cumulative logprob
    add_special_tokens: bool = True  # the tokenizer's BOS before a text prompt (when its config adds one)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ToolFunction(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name", "tool_calls": checked by role below
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the last (assistant) message is continued, left open
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False  # the template writes BOS itself
    chat_template: str | None = None  # a Jinja template for this request (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"thinking": true}
    # OpenAI's reasoning models' switch: anything but "none" turns DeepSeek's thinking on
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking_token_budget: StrictInt | None = None  # vLLM's: at most this many reasoning tokens, then </think>


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]
