"""A failing device step fails only the requests in it; the engine keeps serving the rest exactly.
Also: engine log-probabilities equal log-softmax of the step's logits."""

import numpy as np
import pytest

from deepinfer import SamplingParams
from deepinfer.runtime.engine import EngineConfig, LLMEngine, StepFailed
from tests.reference import load_case
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, drain


class FaultyEngine(LLMEngine):
    """Raises in the step that first carries request ``victim`` (as a device error would)."""

    victim = "r3"

    def _run(self, plan, shape):
        if any(r.request_id == self.victim for r, _ in plan.scheduled) and not getattr(self, "fired", False):
            self.fired = True
            raise RuntimeError("injected device failure")
        return super()._run(plan, shape)


@pytest.mark.parametrize("overlap", [True, False])
def test_failed_step_fails_only_its_requests(overlap, reference_streams):
    case = load_case("mixed")
    prompts, expected = reference_streams
    engine = FaultyEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=13, overlap=overlap, **ENGINE_KW))
    reqs, failed = {}, []
    pending = list(range(len(prompts)))
    while engine.has_unfinished or pending:
        if pending:
            i = pending.pop(0)
            reqs[f"r{i}"] = engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]), f"r{i}")
        try:
            engine.step()
        except StepFailed as e:
            failed += e.failed
            assert "injected device failure" in str(e)
    engine.check_all_free()
    assert "r3" in {r.request_id for r in failed}
    for r in failed:
        assert r.finish_reason == "error" and "injected device failure" in r.error
    survivors = [i for i in range(len(prompts)) if reqs[f"r{i}"] not in failed]
    assert len(survivors) >= 5  # the failure took the step's requests, not the engine
    for i in survivors:
        assert reqs[f"r{i}"].output_token_ids == expected[i], i


def test_logprobs_are_log_softmax_of_logits():
    case = load_case("mixed")
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, keep_logits=True, **ENGINE_KW))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, case.cfg.vocab_size, n).tolist() for n in (3, 11, 20)]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=5),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=0),
              SamplingParams(temperature=0, max_tokens=6)]
    reqs = drain(engine, prompts, lambda i: params[i], arrive_per_step=1, first=1)
    for i in range(2):
        req = reqs[f"r{i}"]
        k = params[i].logprobs
        assert sorted(req.token_logprobs) == list(range(len(req.output_token_ids)))
        for j, token in enumerate(req.output_token_ids):
            logits = req.logits[j].astype(np.float64)
            ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            chosen, ids, lps = req.token_logprobs[j]
            assert abs(chosen - ref[token]) < 1e-5
            assert ids == np.argsort(-ref, kind="stable")[:k].tolist()
            np.testing.assert_allclose(lps, ref[ids], atol=1e-5)
    assert reqs["r2"].token_logprobs == {}
