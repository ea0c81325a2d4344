"""Block tables as wide as a step's contexts need (runtime/context_widths.py): each request gets the
tokens (and logits) it gets alone, every decode step runs in the narrowest width its rows' pages fit,
warm-up compiles those programs (nothing compiles later), a background warm-up uses one only once it
is compiled, batch-invariant mode keeps one width; the defaults and bad values."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from deepinfer import SamplingParams
from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4 import forward
from deepinfer.runtime import context_widths
from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.runtime.engine import LLMEngine
from deepinfer.scheduler.plan import PlanShape
from deepinfer.scheduler.scheduler import PoolSpec
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, drain
from tests.reference import load_case

CONTEXTS = (16, 32, 64)  # mixed case, page_size 4: csa (ratio 4) 1, 2, 4 pages; hca (ratio 8) 1, 1, 2; full (6, 3)
MODES = {"overlap": dict(keep_logits=True), "no_overlap": dict(overlap=False),
         "bursts": dict(num_continuous_decode_steps=2)}
# token buckets (8, 32), then the 8-token one at 3 narrower widths; with bursts the 8-token burst too, at each width
PROGRAMS = {"overlap": 2 + 3, "no_overlap": 2 + 3, "bursts": 3 + 6}


def test_default_context_buckets_and_bad_values():
    assert EngineConfig().context_bucket_sizes() == ()  # max_model_len 1024: one width
    assert EngineConfig(max_model_len=2048).context_bucket_sizes() == ()
    assert EngineConfig(max_model_len=4096).context_bucket_sizes() == (1024,)
    assert EngineConfig(max_model_len=131072).context_bucket_sizes() == (2048, 8192, 32768)
    assert EngineConfig(max_model_len=4096, context_buckets=()).context_bucket_sizes() == ()
    assert EngineConfig(context_buckets=(512, 64, 512)).context_bucket_sizes() == (64, 512)
    for bad in [(0,), (1024,), (2.5,), (True,)]:
        with pytest.raises(ValueError, match=r"context_buckets must be integers in \[1, max_model_len 1024\)"):
            EngineConfig(context_buckets=bad)


def _fake_engine(batch_invariant=False, warming=None):
    pools = (PoolSpec("csa", 4, 16, 100), PoolSpec("hca", 128, 16, 10))
    config = EngineConfig(max_model_len=16384, max_num_seqs=4, batch_invariant=batch_invariant)
    engine = SimpleNamespace(config=config, cfg=SimpleNamespace(batch_invariant=batch_invariant), pools=pools,
                             max_pages=(256, 8), num_drafts=0, token_buckets=(1, 2, 4, 16), warming=warming)
    engine.context_widths = context_widths.widths(engine)
    return engine


def _plan(*pages):
    reqs = [SimpleNamespace(pages={"csa": list(range(c)), "hca": list(range(h))}) for c, h in pages]
    return SimpleNamespace(scheduled=[(r, 1) for r in reqs])


def test_widths_follow_the_contexts_and_a_step_takes_the_narrowest_its_rows_fit():
    engine = _fake_engine()
    # contexts 1024 and 4096 at ratio 4 / 128, 16 rows a page; hca's 1024 needs half a page: one
    assert engine.context_widths == ((16, 1), (64, 2), (256, 8))
    shape = PlanShape(4, 4, engine.max_pages)
    assert context_widths.narrowed(engine, _plan((3, 1), (16, 1)), shape).max_pages == (16, 1)
    assert context_widths.narrowed(engine, _plan((3, 1), (17, 1)), shape).max_pages == (64, 2)
    assert context_widths.narrowed(engine, _plan((3, 2)), shape).max_pages == (64, 2)  # any pool may need more
    assert context_widths.narrowed(engine, _plan((65, 1)), shape) == shape
    prefill = PlanShape(16, 4, engine.max_pages)  # past the bucket of a full decode step (4 rows): full width
    assert context_widths.narrowed(engine, _plan((1, 1)), prefill) == prefill
    shapes = [PlanShape(t, min(t, 4), engine.max_pages) for t in engine.token_buckets]
    assert [(s.num_tokens, s.max_pages) for s in context_widths.narrow_shapes(engine, shapes)] == [
        (1, (16, 1)), (2, (16, 1)), (4, (16, 1)), (1, (64, 2)), (2, (64, 2)), (4, (64, 2))]


def test_a_background_warm_up_serves_narrow_only_once_compiled_and_batch_invariance_keeps_one_width():
    warming = SimpleNamespace(ready_shapes=set())
    engine = _fake_engine(warming=warming)
    shape = PlanShape(2, 2, engine.max_pages)
    assert context_widths.narrowed(engine, _plan((2, 1)), shape) == shape  # nothing narrow compiled yet
    warming.ready_shapes.add(PlanShape(2, 2, (64, 2)))
    assert context_widths.narrowed(engine, _plan((2, 1)), shape).max_pages == (64, 2)  # the one ready
    warming.ready_shapes.add(PlanShape(2, 2, (16, 1)))
    assert context_widths.narrowed(engine, _plan((2, 1)), shape).max_pages == (16, 1)
    bi = _fake_engine(batch_invariant=True)
    assert bi.context_widths == ((256, 8),)
    assert context_widths.narrowed(bi, _plan((1, 1)), shape) == shape


# bursts with narrow tables (opt-in bursts, ~45 s) with `pytest -m slow -k narrow_tables_give` (suite time)
@pytest.mark.parametrize("mode", [m if m != "bursts" else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_narrow_tables_give_each_request_its_tokens(mode, reference_streams):
    case = load_case("mixed")
    prompts, expected = reference_streams
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, context_buckets=CONTEXTS,
                                                           **ENGINE_KW, **MODES[mode]))
    assert engine.context_widths == ((1, 1), (2, 1), (4, 2), (6, 3))
    programs = engine.warmup()
    assert programs == PROGRAMS[mode]
    used = []
    run = engine._run

    def spy(plan, shape):
        need = context_widths.pages_needed(plan, engine.pools)
        fits = [w for w in engine.context_widths if all(n <= m for n, m in zip(need, w))]
        used.append((shape.num_tokens, shape.max_pages, fits[0], shape.steps))
        return run(plan, shape)

    engine._run = spy
    greedy = lambda i: SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i])  # noqa: E731
    with CompileCounter(all_threads=True) as counter:
        reqs = drain(engine, prompts, greedy)
        # then a short, a medium and a long request each alone: their decode steps' widths differ
        for i in (2, 6, 9):
            reqs[f"alone{i}"] = engine.add_request(prompts[i], greedy(i), request_id=f"alone{i}")
            engine.run_until_done()
    assert counter.count == 0
    engine.check_all_free()
    for i in range(len(prompts)):
        assert reqs[f"r{i}"].output_token_ids == expected[i], i
    for i in (2, 6, 9):
        assert reqs[f"alone{i}"].output_token_ids == expected[i], i
    decode_steps = [(w, best) for t, w, best, _ in used if t <= 8]
    assert decode_steps and all(w == best for w, best in decode_steps), used  # always the narrowest that fits
    assert len({w for w, _ in decode_steps}) >= 3, used  # short, medium and long rows
    assert all(w == engine.max_pages for t, w, _, _ in used if t > 8)  # prefill-sized steps: full width
    if mode == "bursts":
        assert any(steps > 1 and w != engine.max_pages for _, w, _, steps in used), used
    if mode == "overlap":  # logits of every generated token against the whole-sequence forward
        fwd = jax.jit(forward, static_argnums=0)
        for i, prompt in enumerate(prompts):
            full = prompt + reqs[f"r{i}"].output_token_ids
            seq = np.zeros((1, 96), np.int32)
            seq[0, : len(full)] = full
            ref = np.asarray(fwd(case.cfg, case.params, seq))[0, len(prompt) - 1: len(full) - 1]
            got = np.stack(reqs[f"r{i}"].logits)
            assert np.max(np.abs(got - ref)) <= 1e-4 * np.max(np.abs(ref)), i
