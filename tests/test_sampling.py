"""Sampling: the filters sample from the intended distribution (chi-square), penalties and
logit_bias change logits exactly as specified, min_tokens, and seeds that reproduce."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from deepinfer import SamplingParams
from deepinfer.engine_config import EngineConfig
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.sampler import apply_logit_bias, apply_penalties, sample
from tests.engine_cases import ENGINE_KW
from tests.reference import load_case

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
N = 6000


def expected(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The intended distribution, written out in numpy (vLLM's definitions)."""
    z = LOGITS.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    q = np.where(keep, p, 0)
    q /= q.sum()
    if top_p < 1:
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        kept = np.zeros_like(keep)
        kept[order[before < top_p]] = True
        q = np.where(kept, q, 0)
        q /= q.sum()
    return q


def draw(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    """N samples: one sequence (seed) at N positions, so the noise differs per draw."""
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, LOGITS.size))
    full = lambda v, dt: jnp.full((N,), v, dt)  # noqa: E731
    toks = jax.jit(sample)(logits, jnp.arange(N), full(seed, jnp.uint32), full(temperature, jnp.float32),
                           full(top_k, jnp.int32), full(top_p, jnp.float32), min_p=full(min_p, jnp.float32))
    return np.bincount(np.asarray(toks), minlength=LOGITS.size)


@pytest.mark.parametrize("kw", [
    {}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.2},
    {"temperature": 1.5, "top_k": 5, "top_p": 0.9}, {"min_p": 0.1, "top_p": 0.95},
])
def test_samples_follow_the_intended_distribution(kw):
    q = expected(**kw)
    counts = draw(**kw)
    assert counts[q == 0].sum() == 0, (counts, q)  # filtered tokens never appear
    support = q > 0
    chi2, p_value = stats.chisquare(counts[support], N * q[support])
    assert p_value > 1e-3, (kw, counts, N * q, p_value)


def test_the_chi_square_check_can_fail():
    """The same check rejects a wrong distribution (temperature 1 vs 0.7's samples)."""
    q, counts = expected(temperature=1.0), draw(temperature=0.7)
    assert stats.chisquare(counts, N * q)[1] < 1e-6


def test_penalties_and_bias_exactly():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (3, 10)).astype(np.int32)
    in_prompt = rng.random((3, 10)) < 0.3
    rep, pres, freq = np.array([1.3, 1.0, 0.8], np.float32), np.array([0.5, 0, -0.2], np.float32), np.array([0.25, 0, 1.0], np.float32)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(in_prompt), jnp.arange(3),
                                     jnp.asarray(rep), jnp.asarray(pres), jnp.asarray(freq)))
    seen = (counts > 0) | in_prompt
    want = np.where(seen, np.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    want = want - freq[:, None] * counts - pres[:, None] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])  # neutral values leave a row alone
    ids = np.array([[2, 7, 10], [0, 10, 10], [9, 9, 10]], np.int32)  # 10 = unused slot
    vals = np.array([[1.5, -100, 0], [2, 0, 0], [1, 1, 0]], np.float32)
    biased = np.asarray(apply_logit_bias(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(vals)))
    want = logits.copy()
    want[0, 2] += 1.5
    want[0, 7] -= 100
    want[1, 0] += 2
    want[2, 9] += 2
    np.testing.assert_allclose(biased, want, rtol=1e-6)


def _engine(case, **kw):
    return LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, keep_logits=True, **{**ENGINE_KW, **kw}))


def run(engine, prompts, params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.run_until_done()
    engine.check_all_free()
    return reqs


def test_engine_applies_penalties_and_bias_as_specified():
    """Greedy under penalties / bias: each chosen token is the argmax of the raw logits
    processed in numpy from the request's own history."""
    case = load_case("mixed")
    engine = _engine(case)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, case.cfg.vocab_size, n).tolist() for n in (5, 12, 30)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={7: 30.0, 9: 29.5}, ignore_eos=True),
    ]
    plain = run(engine, prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3)
    reqs = run(engine, prompts, params)
    for req, sp, base in zip(reqs, params, plain):
        assert req.output_token_ids != base.output_token_ids  # the processing changed something
        for j, token in enumerate(req.output_token_ids):
            x = req.logits[j].astype(np.float64)
            out = req.output_token_ids[:j]
            counts = np.bincount(out, minlength=x.size) if out else np.zeros(x.size)
            seen = (counts > 0) | np.isin(np.arange(x.size), req.prompt_token_ids)
            r = sp.repetition_penalty
            x = np.where(seen, np.where(x > 0, x / r, x * r), x)
            x = x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
            for t, b in sp.logit_bias.items():
                x[t] += b
            assert token == int(np.argmax(x)), (j, token, np.argsort(-x)[:3])
    assert set(reqs[2].output_token_ids) <= {7, 9}


def test_min_tokens_blocks_eos_and_stop_ids():
    case = load_case("mixed")
    engine = _engine(case)
    eos = case.cfg.eos_token_ids[0]
    prompt = [3, 4, 5]
    # a bias makes EOS the greedy choice at every step; min_tokens holds it off for 5 tokens
    sp = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 50.0, 11: 45.0}, min_tokens=5, stop_token_ids=[11])
    (req,) = run(engine, [prompt], [sp])
    assert len(req.output_token_ids) == 6 and req.output_token_ids[-1] == eos
    assert eos not in req.output_token_ids[:5] and 11 not in req.output_token_ids[:5]
    assert req.finish_reason == "stop"


def test_seeds_reproduce_across_engines_and_n_choices_differ():
    case = load_case("mixed")
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=2024, max_tokens=10, ignore_eos=True)
    runs = []
    for _ in range(2):  # two engines: a restart
        engine = _engine(case)
        runs.append([r.output_token_ids for r in run(engine, [prompt] * 4, sp.choices())])
    assert runs[0] == runs[1]
    assert len({tuple(o) for o in runs[0]}) == 4


def test_prompt_logprobs_match_the_full_forward():
    """Each prompt token's logprob given the tokens before it (chunked prefill across steps,
    beside another request) equals log-softmax of the whole-sequence forward."""
    from deepinfer.models.deepseek_v4 import forward

    case = load_case("mixed")
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=8, **ENGINE_KW))
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, case.cfg.vocab_size, 23).tolist()
    other = engine.add_request(rng.integers(0, case.cfg.vocab_size, 5).tolist(), SamplingParams(max_tokens=3))
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    engine.run_until_done()
    engine.check_all_free()
    assert other.prompt_logprobs == {}
    logits = np.asarray(jax.jit(forward, static_argnums=0)(case.cfg, case.params, np.asarray([prompt])))[0].astype(np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    assert sorted(req.prompt_logprobs) == list(range(1, len(prompt)))
    for pos, (chosen, ids, lps) in req.prompt_logprobs.items():
        assert abs(chosen - ref[pos - 1, prompt[pos]]) < 1e-4
        assert ids == np.argsort(-ref[pos - 1], kind="stable")[:3].tolist()
        np.testing.assert_allclose(lps, ref[pos - 1, ids], atol=1e-4)
