"""MTP speculative decoding: greedy token streams equal speculation off, rejection at every
draft position rolls back exactly, the drafter equals the whole-sequence MTP block, bad
settings are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.config import ModelConfig
from deepinfer.default_model import default_model_dir
from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4 import (
    forward_with_intermediates,
    model_spec,
    mtp_forward,
)
from deepinfer.models.deepseek_v4.loader import load_checkpoint
from deepinfer.params import init_params
from deepinfer.runtime.engine import LLMEngine
from deepinfer.scheduler.sampling_params import SamplingParams
from tests.bi_subprocess import run_batch_invariant

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# a sampled row (speculates: its stream differs from speculation off, its distribution does not),
# a penalised row (penalties at each verified position count the drafts before it, not after) and
# one reporting logprobs share the steps with the greedy ones
OTHERS = [
    SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.6,
                   presence_penalty=0.2, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.0, min_tokens=10),  # EOS blocked through the 10th token
    SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
]


@pytest.fixture(autouse=True)
def _release_programs():
    """Every test here builds engines with their own programs: free them as each test ends
    (see conftest._release_compiled_programs)."""
    yield
    import gc

    gc.collect()
    jax.clear_caches()


def _engine(cfg, params, k=0, **kw):
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=192, speculative_config=spec, **kw)
    return LLMEngine(cfg, params, ec)


def _run(engine, prompts, params_list, between_steps=None):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    while engine.has_unfinished:
        engine.step()
        if between_steps is not None:
            between_steps(engine)
    engine.check_all_free()
    return reqs


@pytest.fixture(scope="module")
def bundled():
    cfg, params = load_checkpoint(default_model_dir(), mtp="require")
    rng = np.random.default_rng(0)
    # prompt lengths around the CSA / HCA ratios and the window; 32-token steps chunk the long ones
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 37, 70, 129)]
    prompts += [rng.integers(3, cfg.vocab_size, 9).tolist() for _ in OTHERS]
    sps = [GREEDY] * 4 + OTHERS
    base = _run(_engine(cfg, params), prompts, sps)
    return cfg, params, prompts, sps, base


# k=3 in the default suite (drafts accepted and rejected at several depths); 1, 5 and the
# confidence-scheduled depth with `pytest -m slow` (the suite's time budget)
# ("3-sync": the loop without overlap, which the oracle-draft tests below run by default)
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param("3-sync", marks=pytest.mark.slow),
                               pytest.param(5, marks=pytest.mark.slow), pytest.param("var", marks=pytest.mark.slow)])
def test_greedy_streams_equal_speculation_off(bundled, k):
    """Fixed k, with overlap (the default: rows planned before their previous step's acceptance is
    known) and without ("3-sync"), and confidence-scheduled ("var": up to 5 drafts, chosen per
    request and step from the drafter's confidence and the step costs measured at warm-up)."""
    cfg, params, prompts, sps, base = bundled
    overlap = k != "3-sync"
    k = 3 if k == "3-sync" else k
    engine = _engine(cfg, params, 5 if k == "var" else k, mtp_varlen=k == "var", overlap=overlap)
    assert engine.overlap == overlap
    if k == "var":
        engine.warmup()
        assert engine.scheduler.step_cost is not None
    compiled = engine.num_compiles
    reqs = _run(engine, prompts, sps)
    if k == "var":
        assert engine.num_compiles == compiled  # warm-up compiled the speculative programs
    for i, (got, want) in enumerate(zip(reqs, base)):
        if sps[i].temperature > 0:  # same distribution, not the same stream (test_seeded_* below)
            assert len(got.output_token_ids) == len(want.output_token_ids)
            continue
        assert got.output_token_ids == want.output_token_ids
        assert got.finish_reason == want.finish_reason
    for got, want in zip(reqs[-1:], base[-1:]):  # the logprobs row (speculating) reports the same numbers
        assert sorted(got.token_logprobs) == sorted(want.token_logprobs)
        for i, (lp, ids, _) in want.token_logprobs.items():
            assert got.token_logprobs[i][1] == ids and abs(got.token_logprobs[i][0] - lp) < 1e-5
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens == sum(r.num_draft_tokens for r in reqs) > 0
    assert stats.num_accepted_tokens == sum(r.num_accepted_tokens for r in reqs) == sum(stats.accepted_per_position)
    # the trained MTP head agrees with the model's next-next token often (0.71 on its validation split)
    assert stats.accepted_per_position[0] > 0.5 * stats.num_drafts
    if k != "var":  # drafts accepted at every position, and rejected at every position reached often
        # (k = 5: the fifth position was reached once in this workload, and accepted; rejection at every
        # position is test_rejection_at_every_draft_position_rolls_back_exactly's)
        rates = stats.position_rates()[:k]
        assert all(rate > 0 for rate in rates), stats
        assert all(rate < 1 for rate, n in zip(rates, stats.reached_per_position) if n >= 4), stats
    # penalised, min_tokens and logprobs rows take drafts too
    assert reqs[5].num_draft_tokens > 0 and reqs[6].num_draft_tokens > 0 and reqs[7].num_draft_tokens > 0
    assert 1 not in reqs[6].output_token_ids[:10]


def _assert_first_draft_is_mtp_prediction(cfg, params, prompt, req, fed_from: int = 0) -> None:
    """req's first draft (after its first token) and its confidence are those of mtp_forward over
    the positions the drafter was fed since ``fed_from`` (the inputs at p: streams at p, token p + 1)."""
    first, draft, confidence = req.output_token_ids[0], req.drafts[0], req.draft_confidence[0]
    seq = jnp.asarray([prompt + [first]])
    _, streams, _ = jax.jit(forward_with_intermediates, static_argnums=0)(cfg, params, seq)
    positions = jnp.arange(seq.shape[1])[None]
    fed = slice(fed_from, seq.shape[1] - 1)
    logits, _ = jax.jit(mtp_forward, static_argnums=(0, 2))(cfg, params, 0, streams[:, fed],
                                                             seq[:, fed_from + 1:], positions[:, fed])
    last = np.asarray(logits[0, -1])
    assert draft == int(np.argmax(last))
    probs = np.exp(last - last.max()) / np.exp(last - last.max()).sum()
    assert abs(confidence - probs[draft]) < 1e-4


@pytest.mark.slow  # 35 s; the skipped-steps test below checks the feeding through chunks the same way
def test_first_draft_is_the_whole_sequence_mtp_prediction(bundled):
    """The drafter fed through chunked prefill (the host's next prompt token at chunk ends) and the
    target's first token gives the same draft as mtp_forward over the whole sequence."""
    cfg, params, prompts, _, _ = bundled
    prompt = prompts[3]  # 129 tokens: five 32-token chunks
    engine = _engine(cfg, params, 1)
    req = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while not req.output_token_ids or req.output_token_ids[0] is None:
        engine.step()
    _assert_first_draft_is_mtp_prediction(cfg, params, prompt, req)
    engine.run_until_done()


def test_a_drafter_that_skipped_steps_drafts_from_where_it_resumed(bundled):
    """Confidence scheduling at high load skips the drafter (depth 0, feeding included): its window
    then has a gap, and once fed again it must read only what it was fed since. Here the prompt's
    first three chunks skip it; the draft after the first token equals the whole-sequence MTP
    block over the positions fed since (fed through two chunks: the host's next prompt token at the
    chunk's end, then the target's first token), and the stream equals speculation off."""
    cfg, params, prompts, _, base = bundled
    prompt = prompts[3]  # 129 tokens: four 32-token chunks, then one; the drafter's window is 64
    # up to 2 drafts: the gap does not depend on the depth, and k = 5's programs took 223 s of the suite
    engine = _engine(cfg, params, 2, mtp_varlen=True)
    skipping = [True]
    # a cost model under which drafting never pays (then it is free): depth 0 for the first chunks
    engine.scheduler.step_cost = lambda n, r, d, w: 1.0 + (10.0 * d if skipping[0] else 0.0)
    req = engine.add_request(prompt, GREEDY)
    for _ in range(3):
        engine.step()
    skipping[0] = False
    while not req.output_token_ids or req.output_token_ids[0] is None:
        engine.step()
    _assert_first_draft_is_mtp_prediction(cfg, params, prompt, req, fed_from=96)  # positions 96 .. 128
    engine.run_until_done()
    assert req.output_token_ids == base[3].output_token_ids and req.num_accepted_tokens > 0
    engine.check_all_free()


@pytest.fixture(scope="module")
def random_mtp():
    """A random tiny config with every attention type and an MTP block (its drafts are nearly always wrong)."""
    cfg = ModelConfig.from_json_file("configs/tiny_mixed.json")
    params = init_params(model_spec(cfg), jax.random.key(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 23, 41)]
    sps = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    base = _run(_engine(cfg, params), prompts, sps)
    return cfg, params, prompts, sps, base


def test_rejection_at_every_draft_position_rolls_back_exactly(random_mtp):
    """Oracle drafts (the true continuation) wrong at position j, j cycling through 0..k-1 per step:
    exactly j drafts are accepted, the rest roll back, across CSA / HCA row boundaries."""
    cfg, params, prompts, sps, base = random_mtp
    k = 4
    want = {r.request_id: r.output_token_ids for r in base}
    step = {"n": 0, "expected_accepts": {}}

    def oracle(engine):
        step["n"] += 1
        for req in engine.scheduler.running:
            out = req.output_token_ids
            truth = want[req.request_id][len(out) : len(out) + k]
            if len(truth) < k:
                continue
            j = step["n"] % k
            req.drafts = truth[:j] + [(truth[j] + 1) % cfg.vocab_size] + truth[j + 1 :]

    # oracle drafts are set on the host between steps: without overlap (with it, the device's own
    # drafts feed the next step before the host sees them)
    reqs = _run(_engine(cfg, params, k, overlap=False), prompts, sps, between_steps=oracle)
    for got, ref in zip(reqs, base):
        assert got.output_token_ids == ref.output_token_ids
        assert 0 < got.num_accepted_tokens < got.num_draft_tokens


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be 'mtp'"),
        ({"method": "mtp", "num_speculative_tokens": 6}, r"num_speculative_tokens must be an integer in \[1, 5\], got 6"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "got 0"),
        ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, r"unknown keys \['draft_model'\]"),
        ("mtp", "must be a dict"),
    ],
)
def test_bad_speculative_config_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


def test_bad_env_and_missing_mtp_weights_are_refused(monkeypatch, random_mtp):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "9")
    with pytest.raises(ValueError, match=r"DEEPINFER_USE_NEXTN_DECODE must be an integer in \[1, 5\], got '9'"):
        EngineConfig()
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert EngineConfig().num_speculative_tokens() == 2
    cfg, params, *_ = random_mtp
    no_mtp = {k: v for k, v in params.items() if k != "mtp"}
    with pytest.raises(ValueError, match="needs the MTP weights"):
        LLMEngine(cfg, no_mtp, EngineConfig())


def test_llm_and_server_surfaces(bundled, capsys):
    """LLM(speculative_config=...) loads the MTP block and gives the streams of LLM() without it;
    the server refuses a bad --speculative-config at start, naming the value."""
    from deepinfer import LLM
    from deepinfer.serve.__main__ import main

    cfg, _, prompts, _, base = bundled
    spec = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2}, max_model_len=192, warmup=False)
    out = spec.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == base[1].output_token_ids
    assert spec.engine.stats().num_draft_tokens > 0 and len(spec.engine.stats().accepted_per_position) == 2
    assert main(["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 9}']) == 2
    assert "num_speculative_tokens must be an integer in [1, 5], got 9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--speculative-config", "mtp"])
    assert "not JSON" in capsys.readouterr().err


def _batch_invariant_check() -> None:
    """Run in a fresh process with DEEPINFER_BATCH_INVARIANT=1 (the XLA flag must precede JAX)."""
    cfg = ModelConfig.from_json_file("configs/tiny_mixed.json")
    params = init_params(model_spec(cfg), jax.random.key(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 23, 41)]
    sps = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 3
    base = _run(_engine(cfg, params, keep_logits=True), prompts, sps)
    want = {r.request_id: r.output_token_ids for r in base}
    k, step = 3, [0]

    def oracle(engine):  # true continuations, wrong at a cycling position: every rejection point
        step[0] += 1
        for req in engine.scheduler.running:
            truth = want[req.request_id][len(req.output_token_ids) : len(req.output_token_ids) + k]
            if len(truth) == k:
                j = step[0] % (k + 1)  # j == k: all drafts right
                req.drafts = [t if i != j else (t + 1) % cfg.vocab_size for i, t in enumerate(truth)]

    reqs = _run(_engine(cfg, params, k, keep_logits=True, overlap=False), prompts, sps, between_steps=oracle)
    for got, ref in zip(reqs, base):
        assert got.output_token_ids == ref.output_token_ids
        assert len(got.logits) == len(ref.logits) and all(np.array_equal(a, b) for a, b in zip(got.logits, ref.logits))
        assert 0 < got.num_accepted_tokens < got.num_draft_tokens
    # the drafter's own drafts with overlap (rows planned before the previous step is read)
    reqs = _run(_engine(cfg, params, k, keep_logits=True), prompts, sps)
    for got, ref in zip(reqs, base):
        assert got.output_token_ids == ref.output_token_ids
        assert len(got.logits) == len(ref.logits) and all(np.array_equal(a, b) for a, b in zip(got.logits, ref.logits))
    print("BITWISE OK")


@pytest.mark.slow  # 48 s (a batch-invariant subprocess); suite time
def test_batch_invariant_mode_logits_are_bitwise_those_of_speculation_off():
    """In batch-invariant mode the logits at every verified position are bitwise those of plain
    one-token decode steps, whatever the drafts (oracle drafts rejected at every position)."""
    run_batch_invariant("tests.test_speculative", "_batch_invariant_check")


def test_seeded_sampling_with_drafts_is_reproducible_across_schedules(bundled):
    """A seeded sampled request verifying drafts emits the same tokens alone or in a batch
    (noise and acceptance draws are functions of seed and position only)."""
    cfg, params, prompts, _, _ = bundled
    engine = _engine(cfg, params, 3)
    sps = [SamplingParams(max_tokens=20, temperature=0.7, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = _run(engine, prompts[:3], sps)
    alone = [_run(engine, [p], [sp])[0] for p, sp in zip(prompts[:3], sps)]
    assert [r.output_token_ids for r in together] == [r.output_token_ids for r in alone]
    assert sum(r.num_accepted_tokens for r in together) > 0


def _chi_square_p(samples, p1, p2) -> float:
    """p-value that (first, second) token samples follow p1 and, given the first, p2[first]."""
    from scipy import stats

    chi, dof = 0.0, 0
    firsts = np.array([a for a, _ in samples])
    groups = [(np.bincount(firsts, minlength=len(p1)), p1)]
    for t1, q in p2.items():
        seconds = np.array([b for a, b in samples if a == t1], dtype=np.int64)
        if len(seconds) >= 20:
            groups.append((np.bincount(seconds, minlength=len(q)), q))
    for counts, q in groups:
        support = q > 0
        expected = counts.sum() * q[support]
        chi += float(np.sum((counts[support] - expected) ** 2 / expected))
        dof += int(support.sum()) - 1
    return float(stats.chi2.sf(chi, dof))


def test_sampled_verification_keeps_the_distribution(random_mtp):
    """Top-4 sampling at temperature 1 with the drafter replaced by the target's own argmax: the
    second emitted token (verified: accepted with p(draft), else drawn without it) follows the
    model's distribution given the first (chi-square, 500 seeds), and the same check rejects
    samples drawn by a wrong acceptance rule."""
    cfg, params, *_ = random_mtp
    prompt = list(range(10, 20))
    fwd = jax.jit(lambda t: forward_with_intermediates(cfg, params, t)[0][0, -1])

    def top4(logits):
        logits = np.asarray(logits, np.float64)
        keep = np.argsort(-logits)[:4]
        q = np.zeros_like(logits)
        q[keep] = np.exp(logits[keep] - logits[keep].max())
        return q / q.sum()

    p1 = top4(fwd(jnp.asarray([prompt])))
    p2 = {int(t): top4(fwd(jnp.asarray([prompt + [int(t)]]))) for t in np.flatnonzero(p1)}
    mode = {t: int(np.argmax(q)) for t, q in p2.items()}

    def oracle(engine):
        for req in engine.scheduler.running:
            if len(req.output_token_ids) == 1 and req.drafts:
                req.drafts = [mode[req.output_token_ids[0]]]

    n = 500
    sps = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True) for s in range(n)]
    reqs = _run(_engine(cfg, params, 1, overlap=False), [prompt] * n, sps, between_steps=oracle)
    assert all(r.num_draft_tokens >= 1 for r in reqs)  # every second token went through verification
    samples = [tuple(r.output_token_ids[:2]) for r in reqs]
    accepted = sum(b == mode[a] for a, b in samples)
    assert _chi_square_p(samples, p1, p2) > 1e-3
    # the same check on a wrong rule (accept the draft with probability sqrt(p(draft))) rejects it
    rng = np.random.default_rng(0)
    wrong = []
    for _ in range(n):
        a = int(rng.choice(len(p1), p=p1))
        q, d = p2[a], mode[a]
        if rng.random() < np.sqrt(q[d]):
            wrong.append((a, d))
        else:
            rest = np.where(np.arange(len(q)) == d, 0.0, q)
            wrong.append((a, int(rng.choice(len(q), p=rest / rest.sum()))))
    assert _chi_square_p(wrong, p1, p2) < 1e-3
    assert 0 < accepted < n


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_preemption_while_speculating_keeps_greedy_streams(bundled, overlap):
    """Pools too small for the four at once: requests holding drafts are preempted (with overlap,
    while their step with drafts is still in flight), replay their prompt and outputs, draft
    again, and still give speculation off's streams."""
    cfg, params, prompts, sps, base = bundled
    engine = _engine(cfg, params, 3, num_pages=(("csa", 9), ("hca", 2)), overlap=overlap)
    reqs = _run(engine, prompts[:4], sps[:4])
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in base[:4]]
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_a_prefix_cache_hit_drafts_as_without_the_cache(bundled):
    """Speculation meets prefix caching: after a hit (snapshot restored, the MTP ring fed the
    request's own next token by starting the replay one token early) the drafter proposes the
    same drafts and the target accepts the same number as on a cache-off engine."""
    cfg, params, prompts, *_ = bundled
    rng = np.random.default_rng(8)
    a = prompts[3]  # 129 tokens: checkpoints at 64 and 128, the prompt's end at 129
    # b continues a's prompt with other tokens than a's answer: the snapshot at a's end has the MTP
    # ring fed a's first output token at position 128, which is wrong for b
    b = a + rng.integers(3, cfg.vocab_size, 12).tolist()
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = []
    for on in (True, False):
        engine = _engine(cfg, params, 3, enable_prefix_caching=on, prefix_checkpoint_interval=64)
        if on:
            _run(engine, [a], [sp])
        (req,) = _run(engine, [b], [sp])
        ring = np.asarray(engine.state.model["mtp"][0]["window"][0])  # b ran in slot 0 (a had left it)
        runs.append((req.output_token_ids, req.num_draft_tokens, req.num_accepted_tokens, req.num_cached_tokens, ring))
    (tokens, drafted, accepted, cached, ring), (tokens_off, drafted_off, accepted_off, _, ring_off) = runs
    assert cached == 128  # the snapshot at a's end, one token early for the drafter
    assert tokens == tokens_off and (drafted, accepted) == (drafted_off, accepted_off) and accepted > 0
    # the drafter's window ring (it still holds position 128) is b's own, not a's
    assert np.abs(ring - ring_off).max() < 1e-4
