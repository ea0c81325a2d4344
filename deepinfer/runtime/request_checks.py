"""What LLMEngine.add_request refuses before a request reaches the scheduler: every id it names
inside the vocabulary, the sampling parameters within what the step can hold. Each refusal is a
ValueError that names the field."""

from __future__ import annotations

from deepinfer.config import ModelConfig
from deepinfer.scheduler.sampling_params import MAX_BIAS_SLOTS, SamplingParams


def check_request(cfg: ModelConfig, prompt_token_ids, sp: SamplingParams) -> list[int]:
    """The prompt as a list of ints, or ValueError naming what is wrong."""
    if sp.n != 1:
        raise ValueError(f"LLMEngine runs one sequence per request: split n={sp.n} with SamplingParams.choices()")
    ids = [int(t) for t in prompt_token_ids]
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary (size {cfg.vocab_size})")
    bad = [t for t in [*sp.logit_bias, *sp.stop_token_ids, *sp.reasoning_end_token_ids] if t >= cfg.vocab_size]
    if bad:
        raise ValueError(f"logit_bias / stop_token_ids / reasoning_end_token_ids name token ids {bad[:8]} outside the "
                         f"vocabulary (size {cfg.vocab_size})")
    if sp.top_k > cfg.vocab_size:
        raise ValueError(f"top_k must be -1 (off), 0 (off) or at most the vocabulary size {cfg.vocab_size}, got {sp.top_k}")
    if sp.min_tokens and len(set(sp.stop_token_ids) | set(cfg.eos_token_ids)) + len(sp.logit_bias) > MAX_BIAS_SLOTS:
        raise ValueError(f"logit_bias plus the ids min_tokens blocks exceed {MAX_BIAS_SLOTS} entries")
    return ids


def check_options(cache_salt, priority, scheduling_policy: str) -> None:
    """A request's options besides its sampling: a string cache salt, an integer priority (non-zero
    only under scheduling_policy "priority", where it would otherwise be silently ignored)."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority and scheduling_policy != "priority":
        raise ValueError(f"priority {priority} needs scheduling_policy 'priority' (this engine schedules "
                         f"{scheduling_policy!r})")
