"""One choice's output as it arrives from the engine: tokens, log-probabilities, text, finish.

Shared by the offline ``LLM`` and the server. Stop strings are applied here (the
engine only knows token ids): when the text reaches one, the choice is over, its
text is cut before the stop string and its tokens end with the one that
completed it; the caller then aborts the engine request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.text.detokenizer import IncrementalDetokenizer

# (sampled token's logprob, top ids, top logprobs) per output token
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: dict | None = None  # position -> (logprob, top ids, top logprobs), first delta only


@dataclass
class ChoiceOutput:
    index: int
    sampling_params: SamplingParams
    tokenizer: object | None = None  # a tokenizers.Tokenizer (or anything with decode(ids, skip_special_tokens))
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: dict | None = None  # prompt position -> (logprob, top ids, top logprobs), when asked for

    def __post_init__(self):
        sp = self.sampling_params
        self._detok = (
            IncrementalDetokenizer(self.tokenizer, sp.stop, sp.skip_special_tokens, sp.min_tokens,
                                   sp.include_stop_str_in_output, sp.spaces_between_special_tokens)
            if self.tokenizer is not None else None
        )
        if sp.stop and self._detok is None:
            raise ValueError("stop strings need a tokenizer (this model has none); use stop_token_ids")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, new_ids: list[int], new_logprobs: list[TokenLogprobs | None], finish_reason: str | None) -> ChoiceDelta:
        """Take the next tokens (and the engine's finish reason, if it finished). Returns what is new."""
        if self.finished:
            return ChoiceDelta("", [], [], self.finish_reason, self.stop_reason)
        start = len(self.token_ids)
        self.token_ids += new_ids
        self.logprobs += new_logprobs
        text = ""
        if self._detok is not None:
            d = self._detok.add(new_ids)
            text = d.text
            if d.stop is None and finish_reason is not None:
                d = self._detok.finish()
                text += d.text
            if d.stop is not None:
                cut = d.num_tokens
                del self.token_ids[cut:]
                del self.logprobs[cut:]
                finish_reason, self.stop_reason = "stop", d.stop
        if finish_reason == "stop" and self.stop_reason is None and self.token_ids:
            last = self.token_ids[-1]
            if last in self.sampling_params.stop_token_ids:
                self.stop_reason = last
        self.text += text
        self.finish_reason = finish_reason
        return ChoiceDelta(text, self.token_ids[start:], self.logprobs[start:], finish_reason, self.stop_reason)


def take_new(req, sent: int) -> tuple[list[int], list[TokenLogprobs | None], str | None]:
    """A request's output tokens from index ``sent`` that the host knows, their logprobs,
    and its finish reason if it has finished."""
    n = req.num_resolved
    ids = req.output_token_ids[sent:n]
    lps = [req.token_logprobs.get(i) for i in range(sent, n)]
    return ids, lps, (req.finish_reason if req.is_finished else None)
