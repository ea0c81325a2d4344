"""A failing device step fails only the requests in it; the engine keeps serving the rest exactly.
Also: engine log-probabilities equal log-softmax of the step's logits."""

import numpy as np
import pytest

from deepinfer import SamplingParams
from deepinfer.engine_config import EngineConfig
from deepinfer.runtime.engine import LLMEngine, StepFailed
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, drain
from tests.reference import load_case


class FaultyEngine(LLMEngine):
    """Raises in every step that carries request ``victim`` (as bad input would), or only in the
    first one (``once``: a transient device error)."""

    victim = "r3"
    once = False

    def _run(self, plan, shape):
        if any(r.request_id == self.victim for r, _ in plan.scheduled) and not getattr(self, "fired", False):
            self.fired = self.once
            raise RuntimeError("injected device failure")
        return super()._run(plan, shape)


def run_with_faults(engine, prompts):
    reqs, failed, raised = {}, [], 0
    pending = list(range(len(prompts)))
    while engine.has_unfinished or pending:
        if pending:
            i = pending.pop(0)
            reqs[f"r{i}"] = engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]), f"r{i}")
        try:
            engine.step()
        except StepFailed as e:
            raised += 1
            failed += e.failed
            assert "injected device failure" in str(e)
    engine.check_all_free()
    return reqs, failed, raised


@pytest.mark.parametrize("overlap", [True, False])
def test_failed_step_fails_only_the_culprit(overlap, reference_streams):
    """The victim shares its steps with others; probing halves finds it, and only it fails.
    Every bystander (in the failing step or not) gets exactly its undisturbed tokens."""
    case = load_case("mixed")
    prompts, expected = reference_streams
    engine = FaultyEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=13, overlap=overlap, **ENGINE_KW))
    reqs, failed, raised = run_with_faults(engine, prompts)
    assert raised == 1 and [r.request_id for r in failed] == ["r3"]
    assert failed[0].finish_reason == "error" and "RuntimeError: injected device failure" in failed[0].error
    for i in range(len(prompts)):
        if i != 3:
            assert reqs[f"r{i}"].output_token_ids == expected[i], i


def test_transient_failure_fails_nobody(reference_streams):
    """A step that fails once and not again on replay: nobody is blamed, every output is exact."""
    case = load_case("mixed")
    prompts, expected = reference_streams
    engine = FaultyEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=13, **ENGINE_KW))
    engine.once = True
    reqs, failed, raised = run_with_faults(engine, prompts)
    assert raised == 1 and failed == []
    assert [reqs[f"r{i}"].output_token_ids for i in range(len(prompts))] == expected


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
