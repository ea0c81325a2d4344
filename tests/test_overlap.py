"""The overlapped loop (plan step N+1 while step N runs) changes nothing: identical streams."""

import dataclasses

import numpy as np
import pytest

from deepinfer import SamplingParams
from deepinfer.engine_config import EngineConfig
from deepinfer.runtime.engine import LLMEngine
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, alone, drain, workload
from tests.reference import load_case

STOP_IDS = [10, 41, 63, 51]  # tokens these random weights produce often: stops at varied steps


def _params(kind):
    def make(i):
        if kind == "greedy":
            return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], stop_token_ids=STOP_IDS)
        return SamplingParams(temperature=0.9, top_k=40, seed=7 + i, max_tokens=MAX_TOKENS[i], stop_token_ids=STOP_IDS)

    return make


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("pages", [None, (("csa", 6), ("hca", 3))])
def test_overlap_on_and_off_give_identical_streams(kind, pages):
    case = load_case("mixed")
    prompts = workload(case.cfg.vocab_size, seed=2)
    base = EngineConfig(max_num_batched_tokens=13, num_pages=pages, **ENGINE_KW)
    results = {}
    for overlap in (False, True):
        engine = LLMEngine(case.cfg, case.params, dataclasses.replace(base, overlap=overlap))
        reqs = drain(engine, prompts, _params(kind), first=8 if pages else 4)
        results[overlap] = {rid: (r.output_token_ids, r.finish_reason) for rid, r in reqs.items()}
        if pages:
            assert engine.scheduler.num_preemptions > 0
    assert results[True] == results[False]
    reasons = {reason for _, reason in results[True].values()}
    assert reasons == {"stop", "length"}  # requests finished at different steps, for both reasons


def test_short_requests_replaced_every_step_never_read_a_stale_placeholder():
    """40 tiny requests (1-4 prompt tokens, 1-3 outputs) churn through 8 slots; each equals running alone."""
    case = load_case("mixed")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, case.cfg.vocab_size, rng.integers(1, 5)).tolist() for _ in range(40)]
    max_tokens = rng.integers(1, 4, 40).tolist()
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **ENGINE_KW))
    reqs = drain(
        engine, prompts, lambda i: SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens[i]), first=8, arrive_per_step=3
    )
    for i, p in enumerate(prompts):
        expected = alone(case, p, max_tokens[i], temperature=0.8, seeds=i)
        assert reqs[f"r{i}"].output_token_ids == expected, i  # generate() also stops at EOS
        assert reqs[f"r{i}"].finish_reason == ("stop" if len(reqs[f"r{i}"].output_token_ids) < max_tokens[i] else "length")
