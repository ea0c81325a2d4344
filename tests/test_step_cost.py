"""The step-cost model of confidence-scheduled speculation: warm-up figures refined by the loop's
own step times, and the planner asking it only where its answer can change. Host only."""

import random

from deepinfer.scheduler.request import Request
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.scheduler.scheduler import PoolSpec, Scheduler, SchedulerConfig
from deepinfer.scheduler.speculation import plan_drafts, plan_speculation
from deepinfer.scheduler.step_cost import MIN_OBSERVATIONS, StepCostModel

TOKENS, ROWS = (16, 32, 64), (4, 16)


def _warm(depth_ms: dict[int, float], width_ms: float = 0.0) -> StepCostModel:
    """Warm-up figures: every bucket costs 1 ms per 16 tokens plus depth_ms[depth]; wider grids add width_ms."""
    warm = {}
    for t in TOKENS:
        for r in ROWS:
            for d, extra in depth_ms.items():
                warm[(t, r, "depth", d)] = 1e-3 * (t / 16 + extra)
            for w in range(2, 7):
                warm[(t, r, "width", w)] = 1e-3 * width_ms
    return StepCostModel(warm, TOKENS, ROWS)


def test_warm_up_figures_serve_until_the_loop_has_seen_a_key():
    model = _warm({0: 0.0, 1: 0.5})
    assert model.key(20, 16, 1, 2) == (32, 16, 1, 2)  # tokens and rows to their buckets
    assert model.key(1000, 3, 0) == (64, 16, 0, 1)  # past the largest bucket: the largest (and its rows)
    assert model.key(3, 3, 0) == (16, 16, 0, 1)  # a token bucket is compiled with one row bucket (buckets.py)
    assert abs(model(20, 16, 1, 1) - 2.5e-3) < 1e-12
    plain = model.key(16, 16, 0)
    for _ in range(MIN_OBSERVATIONS - 1):
        model.observe(plain, 2e-3)  # the loop's plain steps take twice their warm-up time
    assert abs(model(16, 16, 0) - 1e-3) < 1e-12  # not seen enough yet
    model.observe(plain, 2e-3)
    assert abs(model(16, 16, 0) - 2e-3) < 1e-12  # its own mean now
    # plain keys not seen yet: their warm-up figure scaled as the seen plain ones are (x2); a
    # speculative key is not (speculation's host work is its own), until speculative ones are seen
    assert abs(model(32, 16, 0) - 2 * 2e-3) < 1e-12
    assert abs(model(32, 16, 1) - 2.5e-3) < 1e-12
    for _ in range(MIN_OBSERVATIONS):
        model.observe(model.key(16, 16, 1, 3), 4.5e-3)  # 3x its warm-up figure of 1.5 ms
    assert abs(model(32, 16, 1) - 3 * 2.5e-3) < 1e-12 and abs(model(32, 16, 0) - 2 * 2e-3) < 1e-12
    model.observe(plain, 4e-3)  # a running mean: 0.8 * 2 + 0.2 * 4 ms
    assert abs(model(16, 16, 0) - 2.4e-3) < 1e-12
    assert model.observed()[plain] == (model(16, 16, 0), MIN_OBSERVATIONS + 1)


def _decoding(n: int, k: int = 5):
    """A scheduler with n requests decoding, each holding k drafts of confidence .9."""
    pools = (PoolSpec("csa", ratio=4, page_size=2, num_pages=64),)
    s = Scheduler(SchedulerConfig(n, 64, 64, n, pools, (1,), num_speculative_tokens=k))
    for i in range(n):
        s.add_request(Request(f"r{i}", list(range(2, 8)), SamplingParams(max_tokens=40, temperature=0.0)))
    plan = s.schedule()
    s.update(plan, {r.request_id: 7 for r, _ in plan.scheduled})
    for r in s.running:
        r.drafts, r.draft_confidence = [9] * k, [0.9] * k
    s.spec_stats.accepted_per_position, s.spec_stats.reached_per_position = [9] * 5, [10] * 5
    return s


def test_a_depth_that_proves_dear_in_the_loop_is_given_up():
    """Warm-up says drafting one token costs 10 % of a step, so at 4 requests the scheduler drafts
    and verifies; the loop then shows such steps cost 5x a plain one (host work the device timing
    did not see), and from then on it runs plain steps (depth 0, nothing verified)."""
    s = _decoding(4)
    model = s.step_cost = _warm({d: 0.1 * d for d in range(6)})
    plan = s.schedule()
    depth = plan.draft_depth["r0"]
    assert depth > 0 and plan.drafts
    s.update(plan, {r.request_id: [7] * (1 + len(plan.drafts[r.request_id])) for r, _ in plan.scheduled})
    for t in TOKENS:  # every drafting shape is seen at 5x a plain step; plain ones as warm-up said
        for d in range(1, 6):
            for w in range(1, 7):
                for _ in range(MIN_OBSERVATIONS):
                    model.observe(model.key(t, 4, d, w), 5e-3 * t / 16)
        for _ in range(MIN_OBSERVATIONS):
            model.observe(model.key(t, 4, 0, 1), 1e-3 * t / 16)
    for r in s.running:
        r.drafts, r.draft_confidence = [9] * 5, [0.9] * 5
    plan = s.schedule()
    assert plan.draft_depth == {r.request_id: 0 for r in s.running} and plan.drafts == {}


def _plans_agree(cands, base, rows, cost, prior):
    exact = plan_drafts(cands, base, rows, cost, prior)
    fast = plan_drafts(cands, base, rows, cost, prior, token_buckets=TOKENS)
    return exact, fast


def test_asking_the_cost_only_at_bucket_edges_plans_the_same():
    """The planner skips plans that cost what the next one does and earn less; over random
    confidences, loads and bucketed costs it chooses exactly what asking at every count does."""
    rng = random.Random(0)
    for case in range(300):
        n = rng.randint(1, 12)
        reqs = []
        for i in range(n):
            r = Request(f"r{i}", [2, 3], SamplingParams(max_tokens=40))
            r.draft_confidence = [rng.choice([0.0, rng.random(), 1.0]) for _ in range(5)]
            reqs.append((r, rng.randint(0, 5)))
        per_token, per_depth, per_width = rng.uniform(0, 0.2), rng.uniform(0, 0.3), rng.uniform(0, 0.2)

        def cost(tokens, rows, width, depth=0):
            t = next((b for b in TOKENS if tokens <= b), TOKENS[-1])
            return 1.0 + per_token * t + per_depth * depth + per_width * (width > 1) * width

        prior = [rng.random() for _ in range(5)]
        exact, fast = _plans_agree(reqs, n, n, cost, prior)
        assert exact == fast, (case, exact, fast)
        steady = [(r, cap) for r, cap in reqs]
        cands = [(r, cap, cap) for r, cap in reqs]
        full = lambda t, r, d, w: cost(t, r, w, d)  # noqa: E731
        assert (plan_speculation(cands, n, n, steady, full, prior, 5)
                == plan_speculation(cands, n, n, steady, full, prior, 5, TOKENS)), case


def test_the_steady_state_value_is_the_ranked_plans_value():
    """plan_speculation prices each depth's steady state position by position; the value is the
    one ranking every draft finds (with and without the bucket edges) among the plans that verify
    some draft (drafting and verifying none is never a depth's steady state)."""
    from deepinfer.scheduler.speculation import _best, _steady_value

    rng = random.Random(1)
    for case in range(200):
        n = rng.randint(1, 12)
        steady = [(Request(f"r{i}", [2, 3], SamplingParams(max_tokens=40)), rng.randint(0, 5)) for i in range(n)]
        prior = [rng.choice([0.0, rng.random(), 1.0]) for _ in range(5)]
        a, b, c = rng.uniform(0, 0.2), rng.uniform(0, 0.3), rng.uniform(0, 0.2)

        def cost(tokens, rows, width):
            t = next((x for x in TOKENS if tokens <= x), TOKENS[-1])
            return 1.0 + a * t + b * rows + c * width

        caps = [cap for _, cap in steady]
        # no confidences of their own: the prior's chances; where some request may draft, only plans
        # that verify a draft count (a cost of nothing verified that earns nothing rules the empty plan out)
        drafting = lambda t, r, w: cost(t, r, w) if t > n or not any(caps) else float("inf")  # noqa: E731
        ranked = _best(steady, n, n, drafting, prior)[1]
        assert abs(_steady_value(caps, n, cost, prior, None) - ranked) < 1e-12, case
        assert abs(_steady_value(caps, n, cost, prior, TOKENS) - ranked) < 1e-12, case


def test_memoised_depth_values_plan_what_recomputing_them_does(monkeypatch):
    """plan_speculation keeps the steady-state values of depths >= 1 while the model's speculative
    prices stay as they were; through a run of observations of both kinds (a plain one leaves them,
    a speculative one drops them) every plan equals the one a memo-less cost function gets."""
    from deepinfer.scheduler import speculation

    priced = []  # the depths whose steady state was computed, not read from the memo
    steady_value = speculation._steady_value
    monkeypatch.setattr(speculation, "_steady_value", lambda caps, *a: priced.append(max(caps, default=0))
                        or steady_value(caps, *a))
    rng = random.Random(2)
    model = _warm({d: 0.1 * d for d in range(6)}, width_ms=0.05)
    fresh = lambda t, r, d, w: model(t, r, d, w)  # noqa: E731  (keeps nothing)
    reqs = [Request(f"r{i}", [2, 3], SamplingParams(max_tokens=40)) for i in range(12)]
    memo_used = 0
    for step in range(400):
        n = rng.choice([4, 8, rng.randint(1, 12)])  # loads repeat, as in a serving loop
        for r in reqs[:n]:
            r.draft_confidence = [rng.random() for _ in range(5)]
        # every request's limit is the draft cap, but now and then one near its max_tokens
        steady = [(r, 5 if rng.random() < 0.95 else rng.randint(0, 5)) for r in reqs[:n]]
        cands = [(r, cap, rng.randint(0, cap)) for r, cap in steady]
        prior = rng.choice([[0.9, 0.8, 0.7, 0.6, 0.5], [0.3] * 5])
        priced.clear()
        planned = plan_speculation(cands, n, n, steady, model, prior, 5, TOKENS)
        memo_used += max(priced) == 0  # only depth 0 priced: every deeper value came from the memo
        assert planned == plan_speculation(cands, n, n, steady, fresh, prior, 5, TOKENS), step
        speculative = rng.random() < 0.3
        key = model.key(rng.choice(TOKENS), n, rng.randint(1, 5) if speculative else 0)
        model.observe(key, 1e-3 * rng.uniform(0.5, 8.0))
    assert memo_used > 20  # the memo was in play, not always dropped


def test_a_depth_that_would_verify_nothing_is_not_chosen():
    """Warm-up noise prices drafting one token 1 % under a plain step; with drafts that are rarely
    accepted, verifying them does not pay, so the steady state of depth 1 would draft every step and
    verify nothing: that is depth 0's work at a higher real price, and depth 0 is chosen."""
    model = _warm({0: 0.0, 1: -0.01, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.5}, width_ms=0.5)
    reqs = [Request(f"r{i}", [2, 3], SamplingParams(max_tokens=40)) for i in range(4)]
    for r in reqs:
        r.draft_confidence = [0.05] * 5
    steady = [(r, 5) for r in reqs]
    cands = [(r, 5, 5) for r in reqs]
    assert plan_speculation(cands, 4, 4, steady, model, [0.05] * 5, 5, TOKENS) == ({}, 0)
    # with drafts worth verifying, depth 1 is still chosen where it pays
    for r in reqs:
        r.draft_confidence = [0.95] * 5
    drafts, depth = plan_speculation(cands, 4, 4, steady, model, [0.95] * 5, 5, TOKENS)
    assert depth >= 1 and drafts


def test_speculation_must_beat_a_plain_step_by_the_margin():
    """A depth >= 1 whose steady state promises less than SPECULATION_MARGIN over depth 0 is not
    chosen (its estimate's error is larger than the gain); one that promises more is."""
    from deepinfer.scheduler.speculation import SPECULATION_MARGIN

    reqs = [Request(f"r{i}", [2, 3], SamplingParams(max_tokens=40)) for i in range(4)]
    steady, cands = [(r, 1) for r in reqs], [(r, 1, 1) for r in reqs]
    for r in reqs:
        r.draft_confidence = [0.5]
    for gain, depth in ((0.5 * (SPECULATION_MARGIN - 1), 0), (2 * (SPECULATION_MARGIN - 1), 1)):
        # plain: 4 tokens per ms; depth 1: 4 + 4 * 0.5 expected tokens in a step priced to promise 1 + gain times that
        cost = lambda t, r, d, w, g=gain: 1e-3 if d == 0 and w == 1 else 1.5e-3 / (1 + g)  # noqa: E731
        assert plan_speculation(cands, 4, 4, steady, cost, [0.5], 1)[1] == depth, gain
