"""SamplingParams, shaped like vLLM's: invalid values fail at construction, naming the field."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from deepinfer.grammar.spec import StructuredOutputsParams

MAX_LOGPROBS = 20  # alternatives per token the device computes (OpenAI's top_logprobs limit)
MAX_N = 16
# Per-row logit-bias slots in a step's plan: the request's logit_bias entries, plus -inf for
# EOS and stop_token_ids while min_tokens is not reached. Fixed, so the plan has a fixed shape.
MAX_BIAS_SLOTS = 64
MAX_LOGIT_BIAS = 48
MAX_STOP_TOKEN_IDS = 15
MAX_STOP = 16  # stop strings per request (each is matched against the text after every token)
MAX_STOP_CHARS = 256
# top_k travels in an int32 field of the step's plan; the engine also caps it at the vocabulary
MAX_TOP_K = 2**31 - 1


def choice_seed(seed: int, index: int) -> int:
    """Seed of choice ``index`` of an n > 1 request: choice 0 keeps the request's seed (so n=1
    and the first of n agree); the others are a fixed mix of (seed, index), each reproducible."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B1 + index * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    return x


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How one request samples, what it reports and when it stops.

    temperature 0 is greedy. top_k <= 0 (vLLM: -1) and top_p == 1 switch those
    filters off. A request without a seed gets a fresh random one, so its
    samples are still a pure function of (seed, position, token id). ``n``
    choices run as n sequences with seeds ``choice_seed(seed, i)``.
    ``logprobs``: None for none, k >= 0 for the sampled token's log-probability
    plus the k most likely alternatives (log-softmax of the model's raw logits).
    ``prompt_logprobs``: None, or k >= 0 for each prompt token's log-probability
    given the tokens before it, plus the k most likely alternatives.
    ``stop``: strings that end the output (matched in the detokenized text,
    across token boundaries; not included in the text unless ``include_stop_str_in_output``).
    ``spaces_between_special_tokens``: how special tokens kept in the text (skip_special_tokens
    False) are joined to it, vLLM's field. ``thinking_token_budget``: vLLM's cap on reasoning
    tokens for outputs that start inside a reasoning block.
    ``structured_outputs``: a StructuredOutputsParams (or its dict: json / regex / choice /
    grammar / json_object / structural_tag); the output follows it, token by token, and ends
    only where it is complete (EOS is masked before that; max_tokens still cuts it: "length").

    Logits are processed on the device in this order: logit_bias (added),
    min_tokens (EOS and stop_token_ids masked until that many tokens exist),
    repetition_penalty (vLLM/HF: divide positive, multiply negative logits of
    tokens in the prompt or output), frequency_penalty * count and
    presence_penalty * seen (subtracted, output tokens only), temperature,
    min_p (drop tokens below min_p * the top probability), top_k, top_p.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    # with skip_special_tokens False: True puts a space between each special token and the text
    # around it (slow tokenizers' convention), False joins them as decoded; None: the tokenizer's own decode
    spaces_between_special_tokens: bool | None = None
    # thinking (the prompt opened a reasoning block): at most this many output tokens of reasoning, then
    # the end marker's token ids (reasoning_end_token_ids) are forced (grammar/thinking_budget.py)
    thinking_token_budget: int | None = None
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                                 f"got {type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                raise ValueError("structured_outputs cannot be combined with ignore_eos (the grammar decides where the output ends)")
            if self.min_tokens:
                raise ValueError("structured_outputs cannot be combined with min_tokens (the grammar decides where the output ends)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop may hold at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or not 0 <= token < 2**31 or not _is_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias entries must map token ids >= 0 to biases in [-100, 100], got {token!r}: {bias!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or t >= 2**31 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids below 2**31, got {self.stop_token_ids!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.thinking_token_budget is not None:
            if not _is_int(self.thinking_token_budget) or self.thinking_token_budget < 0:
                raise ValueError(f"thinking_token_budget must be a non-negative integer or None, got {self.thinking_token_budget!r}")
            if not self.reasoning_end_token_ids:
                raise ValueError("thinking_token_budget needs reasoning_end_token_ids (the token ids of the end marker)")
            self.reasoning_end_token_ids = tuple(int(t) for t in self.reasoning_end_token_ids)
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}")

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def choices(self) -> list["SamplingParams"]:
        """One n=1 SamplingParams per choice, each with its own resolved seed."""
        seed = self.resolved_seed()
        return [dataclasses.replace(self, n=1, seed=choice_seed(seed, i)) for i in range(self.n)]

    def resolved_seed(self) -> int:
        """The seed to sample with: the given one, or a fresh random one."""
        return self.seed if self.seed is not None else secrets.randbits(32)
