"""Shared by the prefix-cache tests: a small engine over the "mixed" reference case (window 8,
CSA ratio 4, HCA ratio 8, pages of 4 rows: page spans of 16 and 32 tokens, blocks of 16,
checkpoints every 32), a 90-token prompt, and runs with the cache on and off."""

import numpy as np

from deepinfer.engine_config import EngineConfig
from deepinfer.runtime.engine import LLMEngine
from deepinfer.scheduler.sampling_params import SamplingParams

KW = dict(max_num_seqs=4, max_model_len=160, page_size=4, max_num_batched_tokens=32, token_buckets=(8, 32),
          row_buckets=(4,), prefix_checkpoint_interval=32, keep_logits=True, check_invariants=True)
INTERVAL = 32


def base_prompt(vocab: int, n: int = 90, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def sharing(prompt: list[int], hit: int, vocab: int, extra: int = 10, seed: int = 2) -> list[int]:
    """A prompt whose first ``hit`` tokens are prompt's (the rest differ from prompt's next token)."""
    rng = np.random.default_rng(seed + hit)
    tail = rng.integers(0, vocab, extra).tolist()
    if hit < len(prompt) and tail[0] == prompt[hit]:
        tail[0] = (tail[0] + 1) % vocab
    return prompt[:hit] + tail


def engine(cfg, params, family=None, **kw) -> LLMEngine:
    return LLMEngine(cfg, params, EngineConfig(**{**KW, **kw}), family=family)


def run_each(eng: LLMEngine, prompts, sp: SamplingParams, salts=None):
    """Each prompt alone, one after the other (so later ones can hit earlier ones)."""
    out = []
    for i, p in enumerate(prompts):
        out.append(eng.add_request(p, sp, cache_salt=salts[i] if salts else None))
        eng.run_until_done()
    eng.check_all_free()
    return out


def max_logit_diff(a, b) -> float:
    assert len(a.logits) == len(b.logits)
    return max(float(np.abs(x - y).max()) for x, y in zip(a.logits, b.logits))


def _batch_invariant_check():
    """In a batch-invariant process: a hit (snapshot and recompute modes) gives bitwise the logprobs
    of a cache-off run, while other requests share its steps."""
    from tests.reference import load_case

    case = load_case("mixed")
    cfg, params, vocab = case.cfg, case.params, case.cfg.vocab_size
    a = base_prompt(vocab)
    b = sharing(a, 70, vocab)
    other = base_prompt(vocab, 40, seed=9)
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=5, logprobs=5)
    for mode in ("snapshot", "recompute"):
        results = []
        for on in (True, False):
            eng = engine(cfg, params, enable_prefix_caching=on, prefix_replay=mode, keep_logits=False)
            run_each(eng, [a], sp)
            rb = eng.add_request(b, sp)
            eng.add_request(other, sp)  # a neighbour in the same steps
            eng.run_until_done()
            eng.check_all_free()
            assert (rb.num_cached_tokens > 0) == on, (mode, rb.num_cached_tokens)
            results.append((rb.output_token_ids, rb.token_logprobs))
        assert results[0] == results[1], mode
    print("BITWISE OK")
