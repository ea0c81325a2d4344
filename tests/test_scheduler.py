"""The host scheduler and allocators, with no JAX anywhere."""

import os
import subprocess
import sys

import numpy as np
import pytest

from deepinfer.scheduler.allocators import OutOfPages, PageAllocator, SlotAllocator
from deepinfer.scheduler.plan import PlanShape, pack
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.scheduler.scheduler import PoolSpec, Scheduler, SchedulerConfig, StepPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(max_num_seqs=4, budget=16, max_model_len=64, slots=4, pages=32, eos=(1,)):
    pools = (PoolSpec("csa", ratio=4, page_size=2, num_pages=pages), PoolSpec("hca", ratio=8, page_size=2, num_pages=pages))
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, slots, pools, eos))


def req(rid, n_prompt, max_tokens=8, **sp):
    return Request(rid, list(range(2, 2 + n_prompt)), SamplingParams(max_tokens=max_tokens, **sp))


def run_step(s, tokens=None):
    """Schedule, then pretend the device sampled `tokens[id]` (default 7) for every sampling row."""
    plan = s.schedule()
    sampled = {r.request_id: (tokens or {}).get(r.request_id, 7) for r, n in plan.scheduled if plan.samples(r, n)}
    return plan, s.update(plan, sampled)


def test_the_engine_package_does_not_import_jax():
    code = "import sys, deepinfer.scheduler.scheduler, deepinfer.scheduler.plan, deepinfer.scheduler, deepinfer.text.output, deepinfer.text.tokenizer; assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_budget_is_respected_and_prefill_is_chunked():
    s = make(budget=10)
    s.add_request(req("a", 25))
    sizes = []
    while s.has_unfinished:
        plan, _ = run_step(s)
        assert plan.num_tokens <= 10
        sizes.append(plan.num_tokens)
    assert sizes[:3] == [10, 10, 5]  # 25-token prompt in chunks; the last chunk samples
    s.check_all_free()


def test_decodes_and_prefill_chunks_share_a_step():
    s = make(budget=8)
    s.add_request(req("a", 3))
    run_step(s)  # a prefilled, sampled its first token
    s.add_request(req("b", 20))
    plan, _ = run_step(s)
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 1), ("b", 7)]


def test_fcfs_and_no_starvation_of_a_long_prompt():
    s = make(budget=8, max_num_seqs=8)
    s.add_request(req("long", 40, max_tokens=2))
    for i in range(6):
        s.add_request(req(f"short{i}", 2, max_tokens=2))
    first_steps = [[r.request_id for r, _ in run_step(s)[0].scheduled] for _ in range(2)]
    assert first_steps[0] == ["long"]  # the head is served first, not skipped for shorter ones
    assert first_steps[1] == ["long"]
    finished_order = []
    while s.has_unfinished:
        finished_order += [r.request_id for r in run_step(s)[1]]
    assert finished_order[0] == "long"
    s.check_all_free()


def test_max_num_seqs_and_slots_bound_the_running_set():
    s = make(max_num_seqs=2, slots=2, budget=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=3))
    plan, _ = run_step(s)
    assert len(plan.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 2
    while s.has_unfinished:
        run_step(s)
        assert len(s.running) <= 2
    s.check_all_free()


def test_finish_reasons():
    s = make(budget=64)
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("stop_id", 3, max_tokens=10, stop_token_ids=[42]))
    s.add_request(req("length", 3, max_tokens=2))
    s.add_request(req("ignore", 3, max_tokens=2, ignore_eos=True))
    reasons = {}
    while s.has_unfinished:
        _, done = run_step(s, tokens={"eos": 1, "stop_id": 42, "length": 5, "ignore": 1})
        reasons.update({r.request_id: (r.finish_reason, len(r.output_token_ids)) for r in done})
    assert reasons == {"eos": ("stop", 1), "stop_id": ("stop", 1), "length": ("length", 2), "ignore": ("length", 2)}
    s.check_all_free()


def test_max_model_len_finishes_with_length():
    s = make(budget=64, max_model_len=10)
    s.add_request(req("a", 6, max_tokens=None))
    while s.has_unfinished:
        _, done = run_step(s)
    assert done[0].finish_reason == "length" and done[0].num_tokens == 10


def test_preemption_frees_the_newest_and_it_resumes_from_scratch():
    # 3 pages of 2 rows per pool; each request grows 1 csa row per 4 tokens
    s = make(budget=64, pages=3, max_model_len=24)
    s.add_request(req("old", 8, max_tokens=12))
    s.add_request(req("new", 8, max_tokens=12))
    preempted, steps = [], 0
    while s.has_unfinished:
        plan, _ = run_step(s)
        preempted += [r.request_id for r in plan.preempted]
        steps += 1
    assert preempted and preempted[0] == "new"  # the newest running request goes first
    assert s.num_preemptions >= 1
    s.check_all_free()


def test_preempted_request_keeps_its_outputs_and_replays_them():
    s = make(budget=64, pages=3, max_model_len=24)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    seen_replay = False
    while s.has_unfinished:
        plan = s.schedule()
        for r, n in plan.scheduled:
            if r.request_id == "b" and r.num_preemptions and plan.starts["b"] == 0:
                assert n == r.num_tokens - 1  # prompt + outputs so far replayed (the last one is a new placeholder)
                assert None not in r.output_token_ids[:-1]
                seen_replay = True
        sampled = {r.request_id: 9 for r, n in plan.scheduled if plan.samples(r, n)}
        s.update(plan, sampled)
    assert seen_replay and b.output_token_ids == [9] * 12 and a.output_token_ids == [9] * 12


def test_abort_frees_everything():
    s = make()
    a, b = req("a", 5), req("b", 5)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.abort(a)
    s.abort(b)
    assert a.finish_reason == "abort" and not s.has_unfinished
    s.check_all_free()


def test_bad_requests_are_refused():
    s = make(max_model_len=10)
    with pytest.raises(ValueError, match="the prompt is empty"):
        s.add_request(req("e", 0))
    with pytest.raises(ValueError, match="prompt of 10 tokens leaves no room to generate within max_model_len 10"):
        s.add_request(req("l", 10))


@pytest.mark.parametrize(
    "kw, text",
    [
        ({"temperature": -1}, r"temperature must be a number in \[0, 100\]"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -5}, "top_k must be -1"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"seed": -1}, "seed must be an integer"),
        ({"n": 0}, r"n must be an integer in \[1, 16\]"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
        ({"stop": [""]}, "stop must be non-empty strings"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative"),
    ],
)
def test_sampling_params_validation(kw, text):
    with pytest.raises(ValueError, match=text):
        SamplingParams(**kw)


def test_allocators():
    pool = PageAllocator("csa", 4)
    pages = pool.allocate(3)
    assert pages == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(OutOfPages, match="2 pages wanted, 1 free"):
        pool.allocate(2)
    pool.share(1)
    pool.free(pages)
    assert pool.num_free == 3  # page 1 still held by its second owner
    with pytest.raises(AssertionError, match=r"pages still held: \[1\]"):
        pool.check_all_free()
    pool.free([1])
    pool.check_all_free()
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([1])
    slots = SlotAllocator(2)
    assert slots.allocate() == 0 and slots.allocate() == 1 and slots.allocate() is None
    slots.free(0)
    with pytest.raises(ValueError, match="freed twice"):
        slots.free(0)


def test_pack_layout():
    s = make(budget=16)
    s.add_request(req("a", 5, temperature=0.5, top_k=3, seed=11))
    run_step(s)
    s.add_request(req("b", 6, seed=12, logit_bias={9: 2.5}, presence_penalty=0.5))
    plan = s.schedule()
    shape = PlanShape(num_tokens=16, num_rows=4, max_pages=(8, 4))
    ints, floats = pack(plan, s.config.pools, shape, num_slots=4, seeds={"a": 11, "b": 12})
    t, r = 16, 4
    tokens, positions, token_row, valid = ints[:t], ints[t : 2 * t], ints[2 * t : 3 * t], ints[3 * t : 4 * t]
    assert tokens[:7].tolist() == [7, 2, 3, 4, 5, 6, 7] and valid.tolist() == [1] * 7 + [0] * 9
    assert positions[:7].tolist() == [5, 0, 1, 2, 3, 4, 5] and token_row[:7].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert (ints[4 * t : 5 * t] == -1).all()  # next_prompt_token: nobody asked for prompt logprobs
    assert (ints[5 * t : 6 * t] == -1).all()  # next_token: every chunk ends at its request's known tokens
    rows = ints[6 * t : 6 * t + 14 * r].reshape(14, r)
    slot, length, n_new, start, sample, seed, top_k, logprobs, prompt_len, num_draft, write_from, history, follows, \
        depth = rows
    assert slot.tolist() == [0, 1, 4, 4] and length[:2].tolist() == [5, 0] and n_new[:2].tolist() == [1, 6]
    assert start[:2].tolist() == [0, 1] and sample[:2].tolist() == [1, 1] and seed[:2].tolist() == [11, 12]
    assert top_k[:2].tolist() == [3, 0] and prompt_len[:2].tolist() == [5, 6] and logprobs[:2].tolist() == [0, 0]
    assert num_draft.tolist() == [0, 0, 0, 0]
    assert write_from.tolist() == history.tolist() == [0, 0, 0, 0]  # no prefix hit
    assert follows.tolist() == depth.tolist() == [0, 0, 0, 0]  # no speculation
    at = 6 * t + 14 * r
    csa_table = ints[at : at + 8 * r].reshape(r, 8)
    assert csa_table[0, 0] == plan.scheduled[0][0].pages["csa"][0] and csa_table[2].tolist() == [32] * 8
    bias_ids = ints[at + 8 * r + 4 * r :].reshape(r, -1)
    assert bias_ids[1, :2].tolist() == [9, 0] and (bias_ids[0] == 0).all()  # vocab_size 0 here: unused slots
    flo = floats[: 6 * r].reshape(6, r)  # temperature, top_p, min_p, repetition, presence, frequency
    np.testing.assert_allclose(flo[:, :2], [[0.5, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.5], [0.0, 0.0]])
    assert floats[6 * r :].reshape(r, -1)[1, 0] == 2.5


def test_packer_many_rows_and_its_reused_padding():
    """More than 8 rows fill the block tables in one vectorised write; seeds keep their uint32 bits;
    a Packer reuses its padding template per shape without one step's rows leaking into the next."""
    from deepinfer.scheduler.plan import Packer

    s = make(max_num_seqs=12, slots=12, budget=64, max_model_len=64, pages=64)
    for i in range(10):
        s.add_request(req(f"r{i}", 3 + i % 4))
    plan = s.schedule()
    shape = PlanShape(num_tokens=64, num_rows=16, max_pages=(8, 4))
    seeds = {f"r{i}": 2**32 - 1 - i for i in range(10)}
    packer = Packer(s.config.pools, 12, 100)
    ints, _ = packer.pack(plan, shape, seeds)
    t, r = 64, 16
    rows = ints[6 * t : 6 * t + 14 * r].reshape(14, r)
    assert rows[5, :10].view(np.uint32).tolist() == [2**32 - 1 - i for i in range(10)]
    at = 6 * t + 14 * r
    for k, (name, m) in enumerate((("csa", 8), ("hca", 4))):
        table = ints[at : at + m * r].reshape(r, m)
        for i, (rq, _) in enumerate(plan.scheduled):
            pages = rq.pages.get(name, [])
            assert table[i, : len(pages)].tolist() == pages and (table[i, len(pages) :] == 64).all()
        assert (table[10:] == 64).all()
        at += m * r
    # the next step packs 2 rows in the same shape: nothing of the 10 above remains
    plan2 = StepPlan()
    plan2.add(plan.scheduled[0][0], 1)
    ints2, floats2 = packer.pack(plan2, shape, seeds)
    fresh, fresh_f = Packer(s.config.pools, 12, 100).pack(plan2, shape, seeds)
    assert np.array_equal(ints2, fresh) and np.array_equal(floats2, fresh_f)
    empty, _ = packer.pack(StepPlan(), shape, {})
    assert (empty[:t] == 0).all() and (empty[2 * t : 3 * t] == r - 1).all() and (rows[0, 10:] == 12).all()


def test_pools_too_small_for_one_request_are_refused_at_construction():
    with pytest.raises(ValueError, match="pool 'csa' cannot hold even one request of max_model_len tokens"):
        make(pages=2, max_model_len=24)  # 24 tokens need 6 csa rows = 3 pages of 2


def _speculative(max_model_len=64, k=3):
    pools = (PoolSpec("csa", ratio=4, page_size=2, num_pages=32),)
    return Scheduler(SchedulerConfig(4, 16, max_model_len, 4, pools, (1,), num_speculative_tokens=k))


def test_drafts_are_verified_and_rejected_ones_rolled_back():
    s = _speculative()
    s.add_request(req("a", 5, max_tokens=20, temperature=0.0))
    run_step(s)  # prefill; the first output is 7
    a = s.running[0]
    a.drafts = [8, 9, 10, 11]
    plan = s.schedule()
    assert plan.scheduled == [(a, 4)] and plan.drafts == {"a": [8, 9, 10]}  # k = 3 of the 4 drafts
    assert a.num_computed == 9
    ints, _ = pack(plan, s.config.pools, PlanShape(16, 4, (8,)), num_slots=4, seeds={"a": 0})
    assert ints[:4].tolist() == [7, 8, 9, 10]  # the last output, then the drafts
    s.update(plan, {"a": [8, 9, 3]})  # two accepted, the third replaced by the target's 3
    assert a.output_token_ids == [7, 8, 9, 3] and a.num_computed == 8 and a.num_pending == 1
    assert (a.num_draft_tokens, a.num_accepted_tokens) == (3, 2)
    assert s.spec_stats.accepted_per_position[:3] == [1, 1, 0]
    assert s.spec_stats.reached_per_position[:4] == [1, 1, 1, 0]  # the third was decided (rejected)
    assert s.spec_stats.position_rates()[:4] == [1.0, 1.0, 0.0, 0.5]  # the fourth never verified


def test_drafts_never_emit_past_max_tokens_or_a_stop():
    s = _speculative()
    s.add_request(req("a", 5, max_tokens=3, temperature=0.0))
    s.add_request(req("b", 5, max_tokens=20, temperature=0.0))
    run_step(s)
    a, b = s.running
    a.drafts, b.drafts = [8, 9, 10], [8, 1, 10]
    plan = s.schedule()
    assert plan.drafts == {"a": [8], "b": [8, 1, 10]}  # a has room for 2 more outputs: one draft + one token
    finished = s.update(plan, {"a": [8, 4], "b": [8, 1, 10, 12]})  # b's 1 is EOS
    assert a.output_token_ids == [7, 8, 4] and a.finish_reason == "length"
    assert b.output_token_ids == [7, 8, 1] and b.finish_reason == "stop"
    assert sorted(r.request_id for r in finished) == ["a", "b"]
    s.check_all_free()


def test_which_requests_take_drafts():
    """Penalised and logprobs requests do (the device counts the drafts before each position); a
    pending min_tokens allows only drafts that stay before it (its EOS block is one per row)."""
    s = _speculative()
    s.add_request(req("a", 3, temperature=0.8, logprobs=1))
    s.add_request(req("b", 3, temperature=0.0, presence_penalty=0.5))
    s.add_request(req("c", 3, temperature=0.8, min_tokens=3, max_tokens=20))  # 1 output so far: room for 1 draft
    s.add_request(req("f", 3, temperature=0.0, min_tokens=10, max_tokens=20))  # far before min_tokens: all
    run_step(s)
    for r in s.running:
        r.drafts = [8, 9, 10]
    plan = s.schedule()
    assert plan.drafts == {"a": [8, 9, 10], "b": [8, 9, 10], "c": [8], "f": [8, 9, 10]}
    assert [n for _, n in plan.scheduled] == [4, 4, 2, 4]
    s = _speculative()
    s.add_request(req("e", 3, temperature=0.0, min_tokens=2, max_tokens=20))  # the next token may be EOS: none
    s.add_request(req("d", 3, temperature=0.8, top_p=0.9))
    run_step(s)
    for r in s.running:
        r.drafts = [8, 9, 10]
    assert s.schedule().drafts == {"d": [8, 9, 10]}


def test_overlap_plans_on_top_of_a_step_with_drafts_in_flight():
    """Step N+1 is planned before step N (3 drafts) is read: as if all were accepted (placeholders,
    num_computed, pages), its row flagged ``follows`` and its drafts left on the device; reading
    step N (one accepted) moves step N+1's outputs to where they belong."""
    s = _speculative()
    s.add_request(req("a", 5, max_tokens=20, temperature=0.0))
    run_step(s)  # prefill; the first output is 7
    (a,) = s.running
    a.drafts = [8, 9, 10]
    step_n = s.schedule()
    assert a.output_token_ids == [7, None, None, None, None] and a.num_computed == 9 and a.in_flight_plan is step_n
    step_n1 = s.schedule()  # step N still in flight
    assert step_n1.drafts == {"a": [None, None, None]} and step_n1.follows == {"a"}
    assert step_n1.starts["a"] == 9 and a.num_computed == 13 and len(a.output_token_ids) == 9
    ints, _ = pack(step_n1, s.config.pools, PlanShape(16, 4, (8,)), num_slots=4, seeds={"a": 0})
    assert ints[:4].tolist() == [-1, -2, -3, -4]  # last token and drafts: the device's own
    assert ints[16:20].tolist() == [9, 10, 11, 12]  # positions as the host assumed (the device shifts them)
    s.update(step_n, {"a": [8, 3]})  # one accepted: two of step N's placeholders go
    assert a.output_token_ids == [7, 8, 3, None, None, None, None] and a.num_computed == 11
    assert a.in_flight_plan is step_n1
    s.update(step_n1, {"a": [4, 5, 6, 2]})  # all accepted
    assert a.output_token_ids == [7, 8, 3, 4, 5, 6, 2] and a.num_computed == 11 and a.num_pending == 1
    assert a.in_flight_plan is None


def test_confidence_scheduling_chooses_the_draft_depth_with_the_drafts():
    """With a step-cost model by (tokens, rows, draft depth, grid width) the scheduler picks the
    depth whose steady state pays best (at the acceptance measured by position) and verifies,
    among the drafts there are (one step old with overlap), what pays at that depth; at high
    load the depth is 0 (the drafter skipped)."""
    s = _speculative(k=5)
    s.step_cost = lambda n, r, d, w: 1.0  # tokens and drafting free: verify and draft all there is
    s.add_request(req("a", 5, max_tokens=30, temperature=0.0))
    prefill = s.schedule()
    assert prefill.draft_depth == {"a": 5}  # the request will decode: its first drafts come after the prompt
    step_1 = s.schedule()  # the prefill still in flight: five drafts on the device
    assert step_1.drafts == {"a": [None] * 5} and step_1.draft_depth == {"a": 5}
    step_2 = s.schedule()
    assert step_2.drafts == {"a": [None] * 5} and step_2.draft_depth == {"a": 5}
    s.update(prefill, {"a": 7})
    s.update(step_1, {"a": [8, 9]})
    s.update(step_2, {"a": [10, 2, 3, 4, 5, 6]})
    assert s.running[0].output_token_ids == [7, 8, 9, 10, 2, 3, 4, 5, 6]
    (a,) = s.running
    a.drafts, a.draft_confidence = [8, 9, 10, 11, 12], [0.9, 0.5, 0.2, 0.1, 0.1]
    # acceptance measured so far, by position: .9, then .5 of those, .2, .1, .1 (survival .9, .45, .09, ...)
    s.spec_stats.accepted_per_position, s.spec_stats.reached_per_position = [900, 450, 90, 9, 1], [1000, 900, 450, 90, 9]
    # each MTP pass costs 10 % of a step (the first comes with the feeding): depth 2 pays best, 3 does
    # not; the five drafts already made cost nothing more to verify, so all are
    s.step_cost = lambda n, r, d, w: 1.0 + 0.1 * d
    step_3 = s.schedule()
    assert step_3.drafts == {"a": [8, 9, 10, 11, 12]} and step_3.draft_depth == {"a": 2}
    s.update(step_3, {"a": [8, 3]})
    # compute-bound: verifying costs what it earns, and drafting costs more: nothing is drafted
    s.step_cost = lambda n, r, d, w: n * (1.0 + 0.1 * d)
    step_4 = s.schedule()
    assert step_4.drafts == {} and step_4.draft_depth == {"a": 0}
    # a wide sampling grid costs: with the third position 'a' would verify, the width rules it out
    s.update(step_4, {"a": 4})
    (a,) = s.running
    a.drafts, a.draft_confidence = [8, 9, 10], [0.9, 0.9, 0.9]
    s.step_cost = lambda n, r, d, w: 1.0 + 0.1 * d + (0.5 if w > 3 else 0.0)
    step_5 = s.schedule()
    assert step_5.drafts == {"a": [8, 9]}


def test_overlap_waits_when_min_tokens_depends_on_the_step_in_flight():
    """Whether EOS is still blocked at the next output depends on how many drafts the step in
    flight accepts: the request sits that step out, then goes on."""
    s = _speculative()
    s.add_request(req("a", 5, max_tokens=20, temperature=0.0, min_tokens=4))
    run_step(s)
    (a,) = s.running
    a.drafts = [8, 9, 10]
    step_n = s.schedule()
    assert step_n.drafts == {"a": [8, 9]}  # outputs 2 and 3 stay before min_tokens 4
    assert s.schedule().scheduled == []  # the next output is index 2..4: undecidable until step N is read
    s.update(step_n, {"a": [8, 3]})
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["a"]


def test_confidence_scheduling_verifies_what_pays_for_its_step_time():
    from deepinfer.scheduler.speculation import plan_drafts

    a, b = req("a", 3), req("b", 3)
    a.draft_confidence, b.draft_confidence = [0.9, 0.9, 0.9], [0.2, 0.9, 0.9]
    cands = [(a, 3), (b, 3)]
    flat = lambda n, r, w: 1.0  # noqa: E731  (tokens are free: verify every draft)
    assert plan_drafts(cands, 2, 2, flat) == {"a": 3, "b": 3}
    linear = lambda n, r, w: float(n)  # noqa: E731  (compute-bound: a token costs as much as it can earn)
    assert plan_drafts(cands, 2, 2, linear) == {}
    # in between: a's drafts (survival .9, .81, .73) beat b's (.2, .18, .16) and are taken first
    step = lambda n, r, w: 1.0 + 0.1 * n  # noqa: E731
    chosen = plan_drafts(cands, 2, 2, step)
    assert chosen.get("a", 0) == 3 and chosen.get("b", 0) < 3
    a.draft_confidence = [0.0, 1.0, 1.0]
    assert "a" not in plan_drafts([(a, 3)], 1, 1, flat)  # survival 0 from the first position on
