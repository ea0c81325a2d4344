"""Decode bursts (EngineConfig.num_continuous_decode_steps): several decode steps in one dispatch
give exactly the tokens of one step per dispatch, with overlap on and off, under preemption, with
stops inside a burst, a prefix hit on what such a request left, and in batch-invariant mode."""

import dataclasses

import jax
import numpy as np
import pytest

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.params import init_params
from deepinfer.runtime.engine import LLMEngine
from tests.bi_subprocess import run_batch_invariant
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, drain, workload
from tests.reference import load_case

STOP_IDS = [10, 41, 63, 51]  # tokens these random weights produce often: stops at varied steps


def _params(kind):
    def make(i):
        stops = STOP_IDS if i % 2 == 0 else []  # the others run to their length
        if kind == "greedy":
            return SamplingParams(temperature=0, max_tokens=3 * MAX_TOKENS[i], stop_token_ids=stops)
        return SamplingParams(temperature=0.9, top_k=40, seed=7 + i, max_tokens=3 * MAX_TOKENS[i],
                              stop_token_ids=stops, repetition_penalty=1.2, presence_penalty=0.3)

    return make


def _streams(engine, prompts, kind, first):
    reqs = drain(engine, prompts, _params(kind), first=first)
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in reqs.items()}


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("pages", [None, (("csa", 8), ("hca", 3))])
def test_bursts_give_the_streams_of_single_steps(kind, pages):
    case = load_case("mixed")
    prompts = workload(case.cfg.vocab_size, seed=2)
    base = EngineConfig(max_num_batched_tokens=13, num_pages=pages, **ENGINE_KW)
    first = 8 if pages else 4
    want = _streams(LLMEngine(case.cfg, case.params, base), prompts, kind, first)
    for overlap in (True, False):
        engine = LLMEngine(case.cfg, case.params, dataclasses.replace(base, overlap=overlap,
                                                                      num_continuous_decode_steps=4))
        assert _streams(engine, prompts, kind, first) == want, overlap
        assert engine.num_decode_bursts > 0 and engine.stats().num_decode_bursts == engine.num_decode_bursts
        if pages:
            assert engine.scheduler.num_preemptions > 0
    reasons = [reason for _, reason in want.values()]
    assert set(reasons) == {"stop", "length"}  # some stopped on a token, inside or at the end of a burst


def test_a_prefix_hit_on_a_request_that_stopped_inside_a_burst():
    """A request that stops on a stop token mid-burst leaves its slot's state a few positions past the
    stop (the burst ran on); the snapshot taken when it leaves must still be the state at the stop: a
    follow-up prompt extending its conversation continues exactly as on an engine without the cache."""
    case = load_case("mixed")
    kw = dict(ENGINE_KW, max_num_batched_tokens=32)
    engine = LLMEngine(case.cfg, case.params, EngineConfig(num_continuous_decode_steps=4, **kw))
    prompt = workload(case.cfg.vocab_size, seed=5)[6]
    first = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=STOP_IDS))
    engine.run_until_done()
    assert first.finish_reason == "stop" and engine.num_decode_bursts > 0
    # output 0 comes from the prefill step, then bursts of 4: the stop (the last output) is not a
    # burst's last token, so the device ran (and wrote) past it
    assert (len(first.output_token_ids) - 2) % 4 != 3, "pick a case whose stop is not a burst's last token"
    follow = prompt + first.output_token_ids + [5, 9, 2]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    hit = engine.add_request(follow, sp)
    engine.run_until_done()
    assert hit.num_cached_tokens > 0
    plain = LLMEngine(case.cfg, case.params, EngineConfig(enable_prefix_caching=False, **kw))
    ref = plain.add_request(follow, sp)
    plain.run_until_done()
    assert hit.output_token_ids == ref.output_token_ids


def test_no_burst_while_a_request_waits_or_wants_logprobs():
    case = load_case("mixed")
    prompts = workload(case.cfg.vocab_size, seed=3)
    engine = LLMEngine(case.cfg, case.params, EngineConfig(num_continuous_decode_steps=4, max_num_batched_tokens=32,
                                                           **ENGINE_KW))
    lp = engine.add_request(prompts[3], SamplingParams(temperature=0, max_tokens=10, logprobs=2))
    other = engine.add_request(prompts[4], SamplingParams(temperature=0, max_tokens=10))
    engine.run_until_done()
    assert engine.num_decode_bursts == 0  # every step held the row that wants logprobs
    assert len(lp.token_logprobs) == 10 and len(other.output_token_ids) == 10
    # the same pair without logprobs: bursts, and the same tokens
    again = [engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=10)) for i in (3, 4)]
    engine.step()
    waiting = engine.add_request(prompts[5], SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # a request waits: that step is a single one (it is admitted in it)
    assert engine.num_decode_bursts == 0
    engine.run_until_done()
    assert engine.num_decode_bursts > 0 and waiting.is_finished
    assert [r.output_token_ids for r in again] == [lp.output_token_ids, other.output_token_ids]


@pytest.mark.parametrize("value", [0, 7, 2.5, True])
def test_bad_burst_lengths_are_refused_naming_the_limit(value):
    with pytest.raises(ValueError, match=r"num_continuous_decode_steps must be an integer in \[1, 6\]"):
        EngineConfig(num_continuous_decode_steps=value)
    EngineConfig(num_continuous_decode_steps=6)
    with pytest.raises(ValueError, match=r"in \[1, 2\] .*max_backtrack 4"):
        EngineConfig(num_continuous_decode_steps=3, max_backtrack=4)


def _batch_invariant_check() -> None:
    """Run in a fresh process with DEEPINFER_BATCH_INVARIANT=1: each request's tokens in bursts of 4
    beside other requests equal its tokens alone, one step per dispatch."""
    cfg = ModelConfig.from_json_file("configs/tiny_mixed.json")
    params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 23, 41)]
    sps = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
           SamplingParams(max_tokens=21, temperature=0.8, seed=3, ignore_eos=True, frequency_penalty=0.4),
           SamplingParams(max_tokens=17, temperature=1.0, seed=9, top_p=0.9, ignore_eos=True)]
    kw = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=64, token_buckets=(4, 16, 64), row_buckets=(4,))
    bursts = LLMEngine(cfg, params, EngineConfig(num_continuous_decode_steps=4, **kw))
    together = [bursts.add_request(p, sp) for p, sp in zip(prompts, sps)]
    bursts.run_until_done()
    assert bursts.num_decode_bursts > 0
    single = LLMEngine(cfg, params, EngineConfig(**kw))
    for p, sp, got in zip(prompts, sps, together):
        ref = single.add_request(p, sp)
        single.run_until_done()
        assert got.output_token_ids == ref.output_token_ids
    print("BITWISE OK")


@pytest.mark.slow  # ~35 s (`pytest -m slow -k batch_invariant_mode_bursts`): suite time
def test_batch_invariant_mode_bursts_give_each_request_its_tokens_alone():
    run_batch_invariant("tests.test_decode_burst", "_batch_invariant_check")


def test_burst_programs_compile_in_the_background_warm_up_and_nothing_after():
    """The bursts' programs are warm-up shapes (compiled last, in the background); the engine bursts
    only once all are ready, and then nothing compiles on any thread."""
    from deepinfer.runtime.compile_guard import CompileCounter

    case = load_case("mixed")
    prompts = workload(case.cfg.vocab_size, seed=2)
    kw = dict(ENGINE_KW, token_buckets=(2, 8, 32), row_buckets=None)
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, num_continuous_decode_steps=3,
                                                           **kw))
    bursts = {s for s in engine.bucket_shapes() if s.steps > 1}
    assert {(s.num_tokens, s.num_rows, s.steps) for s in bursts} == {(2, 2, 3), (8, 8, 3)}  # decode-sized buckets
    assert engine.warmup(background=True) == 1
    want = _streams(LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **kw)), prompts,
                    "seeded", 4)
    assert _streams(engine, prompts, "seeded", 4) == want
    assert engine.wait_warm(timeout=600)
    before = engine.num_decode_bursts
    with CompileCounter(all_threads=True) as counter:
        assert _streams(engine, prompts, "seeded", 4) == want
    assert counter.count == 0 and engine.num_decode_bursts > before
