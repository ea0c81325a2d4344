"""The legacy completions' scoring fields, as OpenAI and vLLM answer them, so evaluation
harnesses (lm-evaluation-harness' loglikelihood, multiple-choice and perplexity tasks) run.

``echo``: the prompt comes back in front of the completion; with ``logprobs`` its tokens'
log-probabilities come first in the listing (the first token's is null: nothing precedes
it). They are the engine's prompt logprobs, computed on the device in the prefill (the
request asks for ``prompt_logprobs`` = ``logprobs``), not a token-by-token host loop.
``max_tokens: 0`` with echo scores the prompt only: the engine samples one token (a
request must end somewhere) and the response leaves it out.
``suffix``: fill in the middle, DeepSeek's FIM format, for tokenizers that have its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.serve.errors import bad_request

FIM_BEGIN, FIM_HOLE, FIM_END = "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"


@dataclass(frozen=True)
class Scoring:
    echo: bool = False
    score_only: bool = False  # max_tokens 0: the prompt's logprobs and nothing generated


def scoring_of(req) -> Scoring:
    zero = req.max_tokens == 0 and "max_tokens" in req.model_fields_set
    if zero and not req.echo:
        raise bad_request("max_tokens 0 generates nothing: send echo: true to score the prompt", "max_tokens")
    return Scoring(bool(req.echo), zero)


def fim_prompt(state, prompt: str, suffix: str) -> str:
    """DeepSeek's fill-in-the-middle prompt: the model writes what goes between prompt and suffix."""
    tok = state.tokenizer.tokenizer if state.tokenizer is not None else None
    missing = [t for t in (FIM_BEGIN, FIM_HOLE, FIM_END) if tok is None or tok.token_to_id(t) is None]
    if missing:
        raise bad_request(f"suffix (fill in the middle) needs a tokenizer with DeepSeek's FIM tokens; this model's "
                          f"lacks {', '.join(missing)}", "suffix")
    return f"{FIM_BEGIN}{prompt}{FIM_HOLE}{suffix}{FIM_END}"


def echo_text(state, prompt, ids: list[int]) -> str:
    """The prompt as the client sent it: its text, or the decoded ids."""
    if isinstance(prompt, str):
        return prompt
    return state.tokenizer.decode(ids, skip_special_tokens=False) if state.tokenizer is not None else ""


def echo_logprobs(prompt_ids: list[int], entries: dict, text_of) -> tuple[dict, int]:
    """The prompt's part of a completions ``logprobs`` listing, and the text offset after it.
    Each top_logprobs entry holds the prompt token itself and the top alternatives."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for pos, token in enumerate(prompt_ids):
        text = text_of(token)[0]
        entry = entries.get(pos) if pos else None
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen, ids, lps = entry
        top = {text: chosen}
        for t, v in zip(ids, lps):
            top.setdefault(text_of(t)[0], v)
        out["token_logprobs"].append(chosen)
        out["top_logprobs"].append(top)
    return out, offset


def join_logprobs(first: dict, second: dict) -> dict:
    return {k: first[k] + second[k] for k in first}
