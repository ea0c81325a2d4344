"""Prefix caching: hits give what a cache-off engine gives, at every alignment, in both replay
modes, with penalties, seeds, drafts, salts, eviction and preemption; batch-invariant mode is
bitwise; a replay shorter than exact does change the outputs (so these tests can fail)."""

from dataclasses import dataclass

import numpy as np
import pytest

from deepinfer.models.deepseek_v4.family import DeepSeekV4
from deepinfer.scheduler.allocators import PageAllocator
from deepinfer.scheduler.prefix_cache import CacheSettings, PrefixCache
from deepinfer.scheduler.sampling_params import SamplingParams
from tests.bi_subprocess import run_batch_invariant
from tests.prefix_cases import (
    INTERVAL,
    base_prompt,
    engine,
    max_logit_diff,
    run_each,
    sharing,
)
from tests.reference import load_case


@pytest.fixture(scope="module")
def case():
    c = load_case("mixed")
    return c.cfg, c.params, c.cfg.vocab_size


GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
PENALISED = SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.6, presence_penalty=0.7,
                           frequency_penalty=0.3)

# (hit length, where it ends, tokens restored from a snapshot): checkpoints at 32, 64 and the
# prompt's end (90); CSA pages span 16 tokens, HCA pages 32, the window is 8
ALIGNMENTS = [
    (37, "inside a CSA page and an HCA page", 32),
    (48, "at a CSA page's end, inside an HCA page", 32),
    (64, "exactly at a checkpoint", 64),
    (70, "mid-window after a checkpoint", 64),
    (90, "exactly at the end of the earlier prompt", 90),
    (89, "the same prompt again (the last token is recomputed)", 89),
]


@pytest.mark.parametrize("hit,where,restored", ALIGNMENTS, ids=[a[1] for a in ALIGNMENTS])
def test_a_hit_gives_the_cache_off_tokens_at_every_alignment(case, hit, where, restored):
    """Greedy, seeded and penalised requests, each at two of the alignments."""
    cfg, params, vocab = case
    a = base_prompt(vocab)
    b = a if hit == 89 else sharing(a, hit, vocab)
    for sp in [(GREEDY, SEEDED, PENALISED)[ALIGNMENTS.index((hit, where, restored)) % 3]]:
        on = engine(cfg, params)
        _, rb = run_each(on, [a, b], sp)
        (off,) = run_each(engine(cfg, params, enable_prefix_caching=False), [b], sp)
        assert rb.num_cached_tokens == restored, where
        assert on.stats().prefix_replayed == hit - restored <= INTERVAL
        assert rb.output_token_ids == off.output_token_ids, where
        assert max_logit_diff(rb, off) < 1e-4, where


@pytest.mark.parametrize("hit", [37, 90])
def test_checkpoint_free_replay_of_the_horizon_is_exact(case, hit):
    cfg, params, vocab = case
    horizon = DeepSeekV4().replay_horizon(cfg, engine(cfg, params).layout)
    assert horizon == 4 * (cfg.sliding_window - 1) + 1  # L(W-1)+1: the window dominates every compressor
    a = base_prompt(vocab)
    b = sharing(a, hit, vocab)
    on = engine(cfg, params, prefix_replay="recompute")
    _, rb = run_each(on, [a, b], SEEDED)
    (off,) = run_each(engine(cfg, params, enable_prefix_caching=False), [b], SEEDED)
    assert rb.num_cached_tokens == hit - horizon
    assert on.stats().snapshots == 0
    assert rb.output_token_ids == off.output_token_ids
    assert max_logit_diff(rb, off) < 1e-4


def test_without_snapshots_a_hit_falls_back_to_replaying_the_horizon(case):
    cfg, params, vocab = case
    a = base_prompt(vocab)
    b = sharing(a, 80, vocab)
    on = engine(cfg, params, prefix_snapshots=0)  # snapshot mode with an empty store (or all evicted)
    _, rb = run_each(on, [a, b], GREEDY)
    (off,) = run_each(engine(cfg, params, enable_prefix_caching=False), [b], GREEDY)
    assert rb.num_cached_tokens == 80 - (4 * (cfg.sliding_window - 1) + 1) and on.stats().snapshots == 0
    assert rb.output_token_ids == off.output_token_ids and max_logit_diff(rb, off) < 1e-4


@dataclass(frozen=True)
class ShortReplay(DeepSeekV4):
    """Claims a horizon of window + backtrack: the replay the seed calls "keep", which is not exact."""

    def replay_horizon(self, cfg, layout):
        return cfg.sliding_window + 2


def test_a_replay_shorter_than_exact_changes_the_outputs(case):
    cfg, params, vocab = case
    a = base_prompt(vocab)
    b = sharing(a, 70, vocab)
    (off,) = run_each(engine(cfg, params, enable_prefix_caching=False), [b], GREEDY)
    short = engine(cfg, params, family=ShortReplay(), prefix_replay="recompute")
    _, rb = run_each(short, [a, b], GREEDY)
    assert rb.num_cached_tokens == 70 - (cfg.sliding_window + 2)
    assert max_logit_diff(rb, off) > 1e-2  # the exact replays above stay below 1e-4


def test_batch_invariant_hits_are_bitwise():
    run_batch_invariant("tests.prefix_cases", "_batch_invariant_check")


def test_multi_turn_chat_reuses_each_turn(case):
    cfg, params, vocab = case
    rng = np.random.default_rng(7)
    sp = SamplingParams(max_tokens=5, temperature=0.0)
    on, off = engine(cfg, params), engine(cfg, params, enable_prefix_caching=False)
    history = rng.integers(0, vocab, 20).tolist()
    previous = 0
    for turn in range(4):
        (r_on,) = run_each(on, [history], sp)
        (r_off,) = run_each(off, [history], sp)
        assert r_on.output_token_ids == r_off.output_token_ids, turn
        if turn:  # restored up to the last turn's answer (its finish snapshot); the answer's last token
            assert r_on.num_cached_tokens == previous - 1, turn  # never entered the model: one token replayed
        previous = len(history) + len(r_on.output_token_ids)
        history = history + r_on.output_token_ids + rng.integers(0, vocab, 9).tolist()


def test_salts_isolate_tenants(case):
    cfg, params, vocab = case
    a = base_prompt(vocab)
    on = engine(cfg, params)
    first, other, same = run_each(on, [a, a, a], GREEDY, salts=["tenant-1", "tenant-2", "tenant-1"])
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 89
    assert first.output_token_ids == other.output_token_ids == same.output_token_ids
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        on.add_request(a, GREEDY, cache_salt=3)


def test_prompt_logprobs_requests_compute_every_position(case):
    cfg, params, vocab = case
    a = base_prompt(vocab)
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    _, rb = run_each(engine(cfg, params), [a, a], sp)
    (off,) = run_each(engine(cfg, params, enable_prefix_caching=False), [a], sp)
    assert rb.num_cached_tokens == 0 and len(rb.prompt_logprobs) == len(a) - 1
    assert all(abs(rb.prompt_logprobs[p][0] - off.prompt_logprobs[p][0]) < 1e-4 for p in off.prompt_logprobs)


def test_eviction_and_preemption_while_hits_share_pages(case):
    """Pools too small for the workload: cached pages are evicted while requests that hit hold
    shared pages, and requests holding shared pages are preempted; every stream is exact and the
    allocator invariant holds after every step (check_invariants)."""
    cfg, params, vocab = case
    a = base_prompt(vocab, 64)
    prompts = [sharing(a, h, vocab, extra=12) for h in (64, 40, 50, 64, 20, 33)] + [base_prompt(vocab, 70, seed=5)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    small = dict(num_pages=(("csa", 14), ("hca", 7)))

    def drain(eng):
        reqs = [eng.add_request(p, sp) for p in prompts[:3]]
        eng.step()
        eng.step()
        reqs += [eng.add_request(p, sp) for p in prompts[3:]]
        eng.run_until_done()
        eng.check_all_free()
        return reqs

    on = engine(cfg, params, **small)
    run_each(on, [a], sp)
    got = drain(on)
    want = drain(engine(cfg, params, enable_prefix_caching=False, **small))
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert on.scheduler.cache.num_evicted > 0
    assert any(r.num_preemptions and r.num_cached_tokens for r in got)  # preempted after sharing pages
    assert sum(r.num_cached_tokens for r in got[:4]) > 0


def _cache(num_pages=8, **kw):
    pools = {"csa": PageAllocator("csa", num_pages)}
    return PrefixCache(CacheSettings(block_size=4, checkpoint_interval=8, num_snapshots=2, **kw), pools,
                       {"csa": (2, 2)}), pools["csa"]


def test_host_cache_chains_blocks_and_evicts_leaves_first():
    cache, pool = _cache()
    chain, pages = [], {"csa": pool.allocate(3)}  # 12 tokens: 6 rows, 3 pages of 2 rows
    tokens = list(range(100, 112))
    assert cache.checkpoint(chain, tokens, 10, pages, None) == 0  # the first snapshot entry
    assert [b.end for b in chain] == [4, 8] and cache.num_blocks == 3  # two whole blocks + the partial one
    hit = cache.lookup(tokens[:10] + [1, 2], None, 11)
    assert (hit.tokens, hit.restore_len, hit.snapshot) == (10, 10, 0)
    assert cache.lookup(tokens, "other tenant", 11) is None
    assert cache.lookup([7] + tokens[1:], None, 11) is None
    # a snapshot before the chain's end (a request restored at 4 holding blocks to 8, then preempted)
    assert cache.checkpoint(chain, tokens, 6, pages, None) == 1 and cache.num_blocks == 4
    assert cache.lookup(tokens[:6] + [1, 2], None, 7).restore_len == 6
    cache.release(chain)
    pool.free(pages["csa"])
    assert pool.num_free == 8 - 3  # the blocks hold the pages
    assert cache.evict("csa", 6) and cache.num_blocks == 3  # the least recently used leaf went first
    assert cache.evict("csa", 8) and cache.num_blocks == 0
    pool.check_all_free()
