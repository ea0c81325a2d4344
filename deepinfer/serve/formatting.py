"""OpenAI response shapes: choices, log-probabilities, usage, SSE lines."""

from __future__ import annotations

import json

from deepinfer.text.detokenizer import byte_decoder, token_bytes
from deepinfer.text.output import TokenLogprobs


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class TokenText:
    """Token id -> (text, bytes) for log-probability listings, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer, or None (ids are shown as "token_id:N")
        self._decoder = byte_decoder()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            if self.tokenizer is None:
                self._cache[token_id] = (f"token_id:{token_id}", [])
            else:
                raw = token_bytes(self.tokenizer, token_id, self._decoder)
                self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token_id]


def text_of_request(state, req):
    """How a request's logprobs name tokens: their text, or "token_id:N" with vLLM's
    return_tokens_as_token_ids (unambiguous where a token is part of a character)."""
    if not getattr(req, "return_tokens_as_token_ids", False):
        return state.text_of
    return lambda token_id: (f"token_id:{token_id}", state.text_of(token_id)[1])


def completion_logprobs(token_ids: list[int], lps: list[TokenLogprobs | None], text_of: TokenText, offset: int) -> dict:
    """The legacy completions ``logprobs`` object for a run of tokens starting at text offset ``offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in zip(token_ids, lps):
        text = text_of(token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(lp[0] if lp else None)
        out["top_logprobs"].append({text_of(t)[0]: v for t, v in zip(lp[1], lp[2])} if lp else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], lps: list[TokenLogprobs | None], text_of: TokenText) -> dict:
    content = []
    for token, lp in zip(token_ids, lps):
        text, raw = text_of(token)
        content.append({
            "token": text,
            "logprob": lp[0] if lp else None,
            "bytes": raw,
            "top_logprobs": [
                {"token": text_of(t)[0], "logprob": v, "bytes": text_of(t)[1]} for t, v in zip(lp[1], lp[2])
            ] if lp else [],
        })
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens the prefix cache let the engine skip."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def prompt_logprobs_listing(prompt_ids: list[int], entries: dict, text_of: TokenText) -> list:
    """vLLM's prompt_logprobs shape: None for the first token, then {token id: {logprob, decoded_token}}
    holding the actual prompt token and the top alternatives."""
    out = [None]
    for pos in range(1, len(prompt_ids)):
        e = entries.get(pos)
        if e is None:
            out.append(None)
            continue
        chosen, ids, lps = e
        item = {str(prompt_ids[pos]): {"logprob": chosen, "decoded_token": text_of(prompt_ids[pos])[0]}}
        for rank, (t, v) in enumerate(zip(ids, lps), start=1):
            item.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text_of(t)[0]})
        out.append(item)
    return out
