"""Warm-up: every step program compiled before serving (or the first one, and the rest on a
worker thread while the engine serves: ``BackgroundWarmup``), and the step-cost model that
confidence-scheduled speculation plans with (seconds per step by token bucket, row bucket
and draft depth, timed on the device)."""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp

from deepinfer.runtime.ahead_of_time import abstract
from deepinfer.runtime.data_parallel import packed_inputs
from deepinfer.runtime.process_agreement import agreed_costs
from deepinfer.runtime.step_program import abstract_inputs
from deepinfer.scheduler.plan import PlanShape, row_field_at
from deepinfer.scheduler.step_cost import StepCostModel
from deepinfer.scheduler.step_plan import StepPlan

log = logging.getLogger("deepinfer.runtime.engine")


def warm_up(engine, progress=None, background: bool = False, begin: bool = True) -> int:
    """Compile the step for every bucket shape (``progress(1)`` after each), and with
    ``EngineConfig.warm_structured`` its two halves (constrained steps with overlap); with
    ``mtp_varlen``, time every shape at every draft depth for the step-cost model.
    ``background``: compile only ``first_shape`` now and the rest on a worker thread while the
    engine serves (not with ``mtp_varlen``: its cost model times every shape on the device first);
    ``begin=False`` leaves the worker to be started (``engine.warming.begin()``) when serving starts.
    Returns the number of step shapes compiled before returning."""
    shapes = engine.bucket_shapes()
    if background and not (engine.num_drafts and engine.config.mtp_varlen) and len(shapes) > 1:
        first = first_shape(shapes)
        # the prefix-cache program compiles on a second core while this thread compiles the step
        ahead = engine.prefix.compile_ahead() if engine.prefix is not None else None
        _compile_by_running(engine, first)
        if ahead is not None:
            ahead.join()
            engine.prefix.warmup()
        if engine.step_timer is not None:  # the warm-up step is not a serving step
            engine.step_timer.drain()
            engine.step_timer.reset()
        # the small decode shapes first (every decode step runs in one), then the larger ones, then
        # decode bursts' programs (the engine uses them once everything is compiled), then the
        # narrower block tables (context_widths.py: each used once it is ready)
        rest = sorted((s for s in shapes if s != first), key=lambda s: (
            s.max_pages != first.max_pages, s.steps > 1, s.num_tokens > first.num_tokens, s.num_tokens))
        structured = _warms_halves(engine)
        engine.warming = BackgroundWarmup(engine, first, rest, structured)
        follow_background(engine)
        if begin:
            engine.warming.begin()
        log.info("warm-up: serving with the %d-token program; %d more compiling in the background (token buckets %s)",
                 first.num_tokens, len(rest), [s.num_tokens for s in rest])
        if progress is not None:
            progress(1)
        return 1
    for shape in shapes:
        _compile_by_running(engine, shape)
        if progress is not None:
            progress(1)
    costs = time_costs(engine, shapes) if engine.num_drafts and engine.config.mtp_varlen else {}
    if costs:
        costs, frozen = agreed_costs(costs)  # several processes: process 0's figures, not refined
        engine.scheduler.step_cost = cost_model(engine, costs)
        engine.scheduler.step_cost.frozen = frozen
    if engine.prefix is not None:
        engine.prefix.warmup()
    if engine.step_timer is not None:  # warm-up steps are not serving steps
        engine.step_timer.drain()
        engine.step_timer.reset()
    return len(engine.compiled_shapes)


def follow_background(engine) -> None:
    """Cap the scheduler's token budget at the largest program ready (a prompt is prefilled in
    chunks that fit it); lift the cap once the background warm-up has compiled everything."""
    if engine.warming.done and not engine.warming.pending:
        engine.warming = None
        engine.scheduler.token_budget = engine.config.max_num_batched_tokens
    else:
        engine.scheduler.token_budget = min(engine.config.max_num_batched_tokens, engine.warming.ready_tokens()[-1])


def wait_background(engine, timeout: float | None = None) -> bool:
    """Block until a background warm-up has compiled every program; True when none is left."""
    if engine.warming is not None:
        engine.warming.wait(timeout)
        follow_background(engine)
    return engine.warming is None


def _warms_halves(engine) -> bool:
    """Whether warm-up compiles the two halves of a constrained step (``warm_structured`` with
    overlap). Not only with a grammar backend: a thinking budget constrains rows through the same
    bitmask (its end marker is forced), so without one they would still compile mid-serving."""
    return engine.config.warm_structured and engine.overlap


def _compile_by_running(engine, shape: PlanShape) -> None:
    """Compile one shape's step by dispatching an empty plan of it, and with
    ``EngineConfig.warm_structured`` its two halves (constrained steps with overlap; otherwise
    compiled on first use). With a program store, they are loaded from it (or compiled ahead of
    time and saved) first: the dispatch then runs the loaded executable."""
    halves = _warms_halves(engine) and shape.steps == 1 and shape.max_pages == engine.max_pages
    if engine.programs.step.store is not None:
        compile_shape(engine.programs, (engine.family, engine.cfg, engine.layout), abstract(engine.params),
                      abstract(engine.state), shape, abstract_inputs(engine, shape), halves=halves)
    engine._run(StepPlan(), shape)
    if halves:
        engine._run_sample(StepPlan(), shape, engine._run_forward(StepPlan(), shape))


def compile_shape(programs, statics: tuple, params, state, shape: PlanShape, inputs: tuple, step: bool = True,
                  halves: bool = False) -> None:
    """Load or compile (program_store.StoredProgram.compile) from abstract arguments the program that
    runs a plan of ``shape`` (``step``), and with ``halves`` the two halves of its constrained step."""
    ints, floats, bitmask = inputs
    if step:
        (programs.burst if shape.steps > 1 else programs.step).compile(*statics, shape, params, state, ints, floats,
                                                                        bitmask)
    if halves:
        fwd = programs.forward.compile(*statics, shape, params, state, ints, floats)
        programs.sample.compile(*statics, shape, params, state, fwd.out_info[0], ints, floats, bitmask)


COST_TRIES = 3  # passes over every timing of the step-cost model; each figure is its fastest


def time_costs(engine, shapes: list[PlanShape]) -> dict:
    """The step-cost model's warm-up figures (step_cost.StepCostModel's ``warm``), at the full block-table
    width: per token bucket, the plain program (depth 0 verifying nothing runs it: engine._shape_for) and
    the speculating one at every draft depth and what each wider sampling grid adds. Timed in interleaved
    passes, every figure once per pass, the fastest kept: one sample each, taken as its program compiled,
    varied 2x between warm-ups (a plain 4-row step of the bundled model read 2.4 ms in one, 4.2 ms in
    another, ~1.9 ms in the loop), and the planner compares depths whose figures differ by a few percent."""
    jobs = []  # (key, shape, depth, grid width)
    for shape in shapes:
        if shape.max_pages != engine.max_pages or shape.steps != 1:
            continue
        t, r = shape.num_tokens, shape.num_rows
        if not shape.num_drafts:
            jobs.append(((t, r, "depth", 0), shape, 0, 1))
        else:
            jobs += [((t, r, "depth", d), shape, d, 1) for d in range(1, engine.num_drafts + 1)]
            jobs += [((t, r, "grid", w), shape, 1, w) for w in range(2, engine.num_drafts + 2)]
    best: dict = {}
    for _ in range(COST_TRIES):
        for key, shape, depth, width in jobs:
            seconds = time_step(engine, shape, depth, width)
            best[key] = min(best.get(key, seconds), seconds)
    costs = {k: v for k, v in best.items() if k[2] == "depth"}
    for (t, r, kind, width), seconds in best.items():
        if kind == "grid":  # what a wider sampling grid adds at depth 1
            costs[(t, r, "width", width)] = max(0.0, seconds - best[(t, r, "depth", 1)])
    return costs


def time_step(engine, shape: PlanShape, depth: int, width: int = 1, repeats: int = 3) -> float:
    """Seconds one step of this shape takes on the device when the drafter drafts ``depth`` (0:
    skipped) and the sampling grid is ``width`` positions wide. A padding-only plan runs the same
    program, so it costs what a full one does; one padding row is made to sample and verify
    width - 1 drafts, so the drafter's loop runs depth - 1 times and the grid's branch is that
    width's (its slot is out of range: every write is dropped). The steps are dispatched back to
    back and waited for once, as the overlapped loop runs them: a step timed alone would also
    count the wait for its result, which the loop hides, and so price every step too high."""
    ints, floats = packed_inputs(engine, StepPlan(), shape, {})
    per_rank = getattr(ints, "ints", ints)  # (data parallelism: every rank's first padding row)
    per_rank[..., row_field_at(shape, "sample")] = 1
    per_rank[..., row_field_at(shape, "draft_depth")] = depth
    per_rank[..., row_field_at(shape, "num_draft")] = width - 1
    ints, floats = jax.tree.map(jnp.asarray, (ints, floats))
    bitmask = engine._bitmask(StepPlan(), shape)

    def run():
        out, engine.state = engine.programs.step(engine.family, engine.cfg, engine.layout, shape, engine.params,
                                           engine.state, ints, floats, bitmask)
        return out

    jax.block_until_ready(run().tokens)  # its branches' first run out of the way
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = run()
    jax.block_until_ready(out.tokens)
    return (time.perf_counter() - t0) / repeats


def cost_model(engine, costs: dict) -> StepCostModel:
    """The step-cost model from the warm-up timings (refined by the loop's own, step_cost.py)."""
    model = StepCostModel(costs, engine.token_buckets, engine.row_buckets)
    log.info("speculation: step cost by token bucket (ms, most rows) at draft depth 0 / 1 / %d: %s", engine.num_drafts,
             {t: tuple(round(1e3 * max(v for (tt, _, kind, d), v in costs.items()
                                       if tt == t and kind == "depth" and d == depth), 2)
                       for depth in (0, 1, engine.num_drafts)) for t in engine.token_buckets})
    return model


def first_shape(shapes: list[PlanShape]) -> PlanShape:
    """The program to serve with alone: the smallest token bucket compiled with the most rows, so
    any step fits it once the token budget is capped at its size (prefill in chunks of it)."""
    most_rows = max(s.num_rows for s in shapes)
    return min((s for s in shapes if s.num_rows == most_rows), key=lambda s: s.num_tokens)


class BackgroundWarmup:
    """Compiles the engine's remaining step programs on a worker thread (ahead of time, from
    abstract arguments: the engine's state is never touched, so the engine keeps stepping).
    A shape's program goes into JAX's own cache, so its first dispatch compiles nothing; the
    engine reads ``ready_tokens()`` each step and only uses (and budgets for) what is ready."""

    PATIENCE_S = 2.0  # before each program: wait this long at most for the engine to go idle

    def __init__(self, engine, first: PlanShape, rest: list[PlanShape], structured: bool):
        self._idle = engine.idle
        self._ready = [first.num_tokens]
        self.ready_shapes: set[PlanShape] = set()  # the narrower block tables' programs compiled so far
        self._full_width = first.max_pages
        self.pending: list[PlanShape] = list(rest)  # shapes not compiled yet, in compile order
        self.error: BaseException | None = None
        self.compile_s = 0.0
        self.then = None  # called on the worker once everything compiled (more start-up work, e.g. grammar)
        self._stop = threading.Event()
        self._done = threading.Event()
        # abstract arguments taken now, on the engine's thread (the worker never reads live arrays,
        # which the engine donates step after step)
        args = (engine.family, engine.cfg, engine.layout)
        self._programs = engine.programs
        params, state = abstract(engine.params), abstract(engine.state)
        jobs = []
        for shape in rest:
            jobs.append((shape, abstract_inputs(engine, shape)))
        self._thread = threading.Thread(target=self._run, args=(args, params, state, jobs, structured),
                                        name="deepinfer-warmup", daemon=True)

    def begin(self) -> None:
        """Start the worker (once). The server starts it when it starts serving: its lowering is
        Python, and would hold the interpreter lock against the server's own start-up."""
        if self._thread.ident is None:
            self._thread.start()

    def _run(self, args, params, state, jobs, structured) -> None:
        t0 = time.perf_counter()
        try:
            for shape, (ints, floats, bitmask) in jobs:
                # tracing and lowering hold the interpreter lock: a request in flight slowed ~10x
                # beside it (bundled model: 4 tokens in 0.9 s, 47 ms alone), so go between requests
                # when there is a gap, and at least every PATIENCE_S under constant load
                self._idle.wait(self.PATIENCE_S)
                if self._stop.is_set():
                    return
                compile_shape(self._programs, args, params, state, shape, (ints, floats, bitmask))
                if shape.max_pages != self._full_width:
                    self.ready_shapes.add(shape)  # (context_widths.narrowed reads it)
                elif shape.steps == 1:  # a token bucket the engine may dispatch now (bursts wait for all)
                    self._ready.append(shape.num_tokens)
                self.pending.remove(shape)
                log.info("warm-up: step program for %d tokens x %d rows%s%s ready (%d still compiling)",
                         shape.num_tokens, shape.num_rows, f" x {shape.steps} steps" if shape.steps > 1 else "",
                         f", block tables {shape.max_pages} pages" if shape.max_pages != self._full_width else "",
                         len(self.pending))
            halves = [job for job in jobs if structured and job[0].steps == 1 and job[0].max_pages == self._full_width]
            for shape, (ints, floats, bitmask) in halves:  # the halves of constrained steps
                self._idle.wait(self.PATIENCE_S)
                if self._stop.is_set():
                    return
                compile_shape(self._programs, args, params, state, shape, (ints, floats, bitmask), step=False, halves=True)
        except BaseException as e:  # the shapes not compiled stay unused; the engine serves with the rest
            self.error = e
            log.error("warm-up: compiling in the background failed (%s: %s); serving with token buckets %s",
                      type(e).__name__, e, sorted(self._ready))
        finally:
            self.compile_s = time.perf_counter() - t0
            self._done.set()
            if self.error is None and not self._stop.is_set():
                log.info("warm-up: all step programs ready (%.1f s in the background)", self.compile_s)
                if self.then is not None:
                    self.then()

    def compiling_tokens(self) -> tuple[int, ...]:
        """Token buckets not usable yet: their full-width, one-step program is still pending (a
        bucket's narrower tables and bursts only make it faster once ready)."""
        return tuple(sorted({s.num_tokens for s in self.pending if s.max_pages == self._full_width and s.steps == 1}))

    def describe_pending(self) -> list[str]:
        """The programs still to compile, one phrase each (for the start-up log)."""
        return [f"{s.num_tokens}" + (f"x{s.steps} steps" if s.steps > 1 else "")
                + (f" ({s.max_pages}-page tables)" if s.max_pages != self._full_width else "") for s in self.pending]

    def ready_tokens(self) -> tuple[int, ...]:
        """Token buckets whose programs are compiled (a snapshot: the list only grows)."""
        return tuple(sorted(self._ready))

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every program is compiled (or the worker stopped); True if it finished."""
        self.begin()
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Ask the worker to stop after the program it is compiling, and wait for it."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
