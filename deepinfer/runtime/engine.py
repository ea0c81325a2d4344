"""LLMEngine: the host scheduler driving the jitted paged step, one step at a time.

    engine = LLMEngine(cfg, params, EngineConfig(max_num_seqs=16, kv_memory_bytes=2**28))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=32))
    while engine.has_unfinished: finished = engine.step()

Pools are sized from a memory budget (``kv_memory_bytes``), logged at start as a
capacity in tokens and requests. Steps are padded to bucket shapes (scheduler/buckets.py);
``warmup()`` compiles them all, or one and the rest in the background (runtime/warmup.py).

Overlap (default): ``step()`` schedules and dispatches step N+1 before it reads
step N's tokens, so the device never waits for the host. Tokens the host does
not know yet go in as placeholders resolved on the device from a per-slot
buffer; results are processed one step late.

Structured outputs: a request with ``SamplingParams.structured_outputs`` holds a grammar
matcher (deepinfer/grammar/); each step the host fills the packed bitmask of the positions
it samples and the step applies it before sampling. With overlap, a step with constrained
rows runs as two programs: the model half is dispatched first, the host reads step N and
fills the masks (they need step N's tokens) while it runs, then dispatches the sampling
half; steps without constrained rows stay one program.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.engine_config import EngineConfig, size_pools
from deepinfer.grammar.backend import GrammarBackend, StructuredOutputsUnavailable
from deepinfer.grammar.step_mask import RequestGrammar, bitmask_words, fill_step_bitmask
from deepinfer.grammar.thinking_budget import ThinkingBudgetMatcher
from deepinfer.kv.paged_state import init_engine_state
from deepinfer.models.interface import ModelFamily, PagedLayout
from deepinfer.models.registry import family_for
from deepinfer.runtime import burst_dispatch, context_widths, data_parallel, process_agreement, recovery, warmup
from deepinfer.runtime.batch_invariance import check_xla
from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.runtime.engine_stats import EngineStats, engine_stats, kv_usage
from deepinfer.runtime.mesh_setup import on_mesh
from deepinfer.runtime.paged_step import PROGRAMS
from deepinfer.runtime.platform import platform_in_use, require_feature
from deepinfer.runtime.program_store import stored_programs
from deepinfer.runtime.prefix_runtime import PrefixRuntime, cache_settings
from deepinfer.runtime.request_checks import check_options, check_request
from deepinfer.runtime.step_results import read_step
from deepinfer.runtime.step_timer import StepTimer
from deepinfer.scheduler.buckets import rows_for, step_shape
from deepinfer.scheduler.data_parallel import DataParallelScheduler
from deepinfer.scheduler.plan import PlanShape
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.scheduler.scheduler import Scheduler, SchedulerConfig, StepPlan

log = logging.getLogger("deepinfer.runtime.engine")


class StepFailed(RuntimeError):
    """A device step failed; ``failed`` are the requests that made it fail (finished with reason "error")."""

    def __init__(self, cause: Exception, failed: list[Request]):
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); {len(failed)} request(s) failed")
        self.cause, self.failed = cause, failed


class LLMEngine:
    def __init__(self, cfg: ModelConfig, params: dict, config: EngineConfig | None = None,
                 family: ModelFamily | None = None, grammar: GrammarBackend | None = None):
        """``family``: the model implementation (models/interface.py); by default the registry's for cfg.
        ``grammar``: the compiler of structured outputs (needs the model's tokenizer); None: refused."""
        config = config or EngineConfig()
        platform = platform_in_use()
        if config.batch_invariant:
            require_feature("batch-invariant mode", platform)
            check_xla(jax.default_backend())
        if config.batch_invariant != cfg.batch_invariant:
            cfg = cfg.replace(batch_invariant=config.batch_invariant)
        family = family or family_for(cfg)
        cfg, params, self.expert_placement = on_mesh(family, cfg, params, config)
        self.cfg, self.params, self.config, self.family = cfg, params, config, family
        # attention data-parallel: each rank its own slots, pools and scheduler (runtime/data_parallel.py)
        self.ranks = data_parallel.num_ranks(cfg)
        self.programs = stored_programs(PROGRAMS if self.ranks == 1 else data_parallel.programs(params),
                                        config.program_cache_dir)  # (runtime/program_store.py)
        self.num_drafts = config.num_speculative_tokens()
        if self.num_drafts:
            if self.family.draft_forward is None:
                raise ValueError(f"speculative decoding: the model family {type(self.family).__name__} has no draft forward")
            self.family.check_draft(cfg, params)
        # with speculation too: a row planned before its previous step is read follows it on the
        # device (its positions shift by what that step accepted; scheduler/speculation.py)
        self.overlap = config.overlap
        self.dtype = jnp.dtype(params["embed"].dtype)
        self.capacity = size_pools(self.family, cfg, config, self.dtype)
        self.pools = self.capacity.pools
        self.layout = PagedLayout(  # (with data parallelism: every rank's slots and pages)
            config.max_num_seqs * self.ranks, config.page_size, tuple((p.name, p.num_pages * self.ranks) for p in self.pools),
            config.max_backtrack, draft=self.num_drafts > 0, expert_load=config.enable_eplb,
        )
        prefix = cache_settings(self.family, cfg, config, self.layout)
        self.scheduler = (Scheduler if self.ranks == 1 else lambda c: DataParallelScheduler(c, self.ranks))(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                num_slots=config.max_num_seqs,
                pools=self.pools,
                eos_token_ids=cfg.eos_token_ids,
                num_speculative_tokens=self.num_drafts,
                prefix_cache=prefix,
                scheduling_policy=config.scheduling_policy,
            )
        )
        self.token_buckets, self.row_buckets = config.buckets()
        self.max_pages = tuple(-(-(config.max_model_len // p.ratio) // p.page_size) for p in self.pools)
        self.context_widths = context_widths.widths(self)  # block-table widths, narrowest first
        if hasattr(self.family, "with_kernels"):  # Pallas kernel or reference per op, for this platform
            self.cfg = cfg = self.family.with_kernels(cfg, self.layout, tuple(max(w, default=1) for w in
                                                                              self.context_widths), self.dtype, platform)
        self.state = init_engine_state(self.family, cfg, self.layout, self.dtype)
        self.prefix = PrefixRuntime(self, prefix) if prefix is not None else None
        self.compiled_shapes: set[PlanShape] = set()
        self.warming: warmup.BackgroundWarmup | None = None  # a background warm-up still compiling
        self.idle = threading.Event()  # set while no request is queued or running (a background warm-up's cue)
        self.idle.set()
        self.packer = data_parallel.packer(self)  # (scheduler/plan.py: keeps each step shape's padding)
        self._seeds: dict[str, int] = {}
        self._seed_source = process_agreement.SeedSource()  # (several processes: one seed for a request without one)
        self._ids = itertools.count()
        # model steps dispatched (a burst counts its steps), decode bursts, programs compiled
        self.num_steps = self.num_decode_bursts = self.num_compiles = 0
        self._inflight: tuple | None = None  # (plan, device outputs) of the step not yet read
        self.updated: list[Request] = []  # requests whose outputs the last step() filled in (finished ones too)
        self.last_wait_s = self.last_host_s = self.host_s = 0.0  # host: step()'s wall time minus waits on device
        self.step_timer = StepTimer() if config.measure_device else None
        self.grammar = grammar
        self.bitmask_words = bitmask_words(cfg.vocab_size)
        self._unconstrained: dict[tuple[int, int], jax.Array] = {}  # (rows, drafts) -> all-ones bitmask
        self.mask_fill_s = self.last_mask_fill_s = 0.0  # host time spent filling grammar masks (all steps; the last)
        c = self.capacity
        log.info(
            "KV capacity: %d tokens, %d requests of max_model_len %d; %d slots; pools %s; %.1f MiB",
            c.tokens, c.requests_at_max_len, config.max_model_len, c.num_slots,
            ", ".join(f"{p.name}={p.num_pages} pages" for p in self.pools), c.bytes_total / 2**20,
        )

    # -- requests -----------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, compiled_grammar=None, cache_salt: str | None = None,
                    priority: int = 0) -> Request:
        """Queue a request. A structured one compiles its grammar here unless ``compiled_grammar``
        (from ``self.grammar.compile``/``submit``, e.g. awaited off the engine thread) is given.
        ``cache_salt``: requests with different salts share no prefix-cache entries (tenants).
        ``priority``: lower is scheduled first under scheduling_policy "priority"; any other policy
        refuses a non-zero one (it would be silently ignored)."""
        sp = sampling_params or SamplingParams()
        ids = check_request(self.cfg, prompt_token_ids, sp)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seeds:
            raise ValueError(f"request id {rid!r} is already in use")
        check_options(cache_salt, priority, self.config.scheduling_policy)
        req = Request(rid, ids, sp, cache_salt=cache_salt, priority=priority)
        matcher = None
        if sp.structured_outputs is not None:
            if self.grammar is None:
                raise StructuredOutputsUnavailable("structured outputs need the model's tokenizer: this engine has none")
            compiled = compiled_grammar if compiled_grammar is not None else self.grammar.compile(sp.structured_outputs)
            matcher = self.grammar.matcher(compiled)
        if sp.thinking_token_budget is not None:  # forces the reasoning's end through the same bitmask
            matcher = ThinkingBudgetMatcher(sp.thinking_token_budget, sp.reasoning_end_token_ids, self.cfg.vocab_size,
                                            matcher)
        if matcher is not None:
            kind = sp.structured_outputs.kind if sp.structured_outputs is not None else "thinking_budget"
            req.grammar = RequestGrammar(matcher, kind)
        self.scheduler.add_request(req)
        self.idle.clear()
        self._seeds[rid] = self._seed_source(sp, rid)
        req.seed = self._seeds[rid]
        return req

    def abort(self, req: Request, reason: str = "abort") -> None:
        """End req now (client gone, stop string seen, ...): its slot and pages are free at once.
        A step already in flight for it still runs; its result is dropped."""
        self.scheduler.abort(req, reason)
        self._seeds.pop(req.request_id, None)
        if not self.has_unfinished:
            self.idle.set()

    def kv_usage(self) -> float:
        """Fraction of the KV pages held by requests (engine_stats.py)."""
        return kv_usage(self.scheduler)

    def stats(self) -> EngineStats:
        return engine_stats(self)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    # -- stepping -----------------------------------------------------------------

    def _shape_for(self, plan: StepPlan) -> PlanShape:
        t, r = step_shape(*data_parallel.counts(plan), self.ready_token_buckets(), self.row_buckets)
        varlen = self.num_drafts > 0 and self.config.mtp_varlen
        if varlen and not plan.drafts and not any(plan.draft_depth.values()):
            # confidence scheduling skipped the drafter and verifies nothing: the plain program does
            # what the speculating one would (drafter state untouched) and costs a plain step
            return PlanShape(t, r, self.max_pages)
        return PlanShape(t, r, self.max_pages, self.num_drafts, varlen)

    def _dispatch_shape(self, plan: StepPlan) -> PlanShape:
        """A one-program step's shape: its buckets, as a decode burst if it may be one, with the narrowest
        block tables its rows fit (runtime/context_widths.py)."""
        return context_widths.narrowed(self, plan, burst_dispatch.shape_for(self, plan, self._shape_for(plan)))

    def _run(self, plan: StepPlan, shape: PlanShape):
        """Dispatch one step (asynchronous: returns device arrays)."""
        return self._run_sample(plan, shape, (*self._pack(plan, shape), None))

    def _pack(self, plan: StepPlan, shape: PlanShape) -> tuple:
        """The packed plan, fresh numpy arrays the program's call moves (~60 us cheaper than device_put)."""
        self._apply_cache_ops(plan)
        return data_parallel.packed_inputs(self, plan, shape, self._seeds)

    def _run_forward(self, plan: StepPlan, shape: PlanShape):
        """Dispatch the model half of a step (structured outputs with overlap: the grammar masks
        are filled while it runs). Returns what ``_run_sample`` needs."""
        ints, floats = self._pack(plan, shape)
        with CompileCounter() as counter:
            fwd, self.state = self.programs.forward(self.family, self.cfg, self.layout, shape, self.params, self.state,
                                                ints, floats)
        self.num_compiles += counter.count
        return ints, floats, fwd

    def _run_sample(self, plan: StepPlan, shape: PlanShape, pending):
        """Fill the plan's grammar masks and dispatch the step (``pending``: packed inputs and, after
        ``_run_forward``, its model half; without one the whole step runs as one program)."""
        ints, floats, fwd = pending
        bitmask = self._bitmask(plan, shape)
        if shape.steps > 1:
            return burst_dispatch.run(self, shape, ints, floats, bitmask)
        with CompileCounter() as counter:
            if fwd is None:
                out, self.state = self.programs.step(self.family, self.cfg, self.layout, shape, self.params, self.state,
                                                 ints, floats, bitmask)
            else:
                out, self.state = self.programs.sample(self.family, self.cfg, self.layout, shape, self.params, self.state,
                                                   fwd, ints, floats, bitmask)
        self.num_compiles += counter.count
        self.compiled_shapes.add(shape)
        wants_lp = any(r.sampling_params.logprobs is not None for r, _ in plan.scheduled)
        wants_plp = any(r.sampling_params.prompt_logprobs is not None for r, _ in plan.scheduled)
        # start the device-to-host copies of what will be read now, not when the host asks
        logprobs = out.logprobs if wants_lp else None
        prompt_logprobs = out.prompt_logprobs if wants_plp else None
        # the plain program (a step that neither verifies nor drafts, _shape_for) has no drafts to read
        drafts = (out.num_emitted, out.drafts, out.draft_confidence) if shape.num_drafts else None
        plan.cost_key = (shape.num_tokens, shape.num_rows, max(plan.draft_depth.values(), default=shape.num_drafts),
                         1 + max(map(len, plan.drafts.values()), default=0))
        for a in (out.tokens, *(drafts or ()), *(logprobs or ()), *(prompt_logprobs or ())):
            a.copy_to_host_async()
        if self.step_timer is not None:
            self.step_timer.dispatched(out.tokens)
        return out.tokens, out.logits, logprobs, prompt_logprobs, drafts

    def _bitmask(self, plan: StepPlan, shape: PlanShape):
        """The step's grammar bitmask (numpy, fresh); a cached all-ones device array when nothing is constrained."""
        t0 = time.perf_counter()
        rows = shape.num_rows * self.ranks  # (data parallelism: every rank's rows, filled in the plan's order)
        mask = fill_step_bitmask(plan, rows, shape.num_drafts + 1, self.bitmask_words)
        self.last_mask_fill_s = time.perf_counter() - t0 if mask is not None else 0.0
        self.mask_fill_s += self.last_mask_fill_s
        if mask is not None:
            return mask if self.ranks == 1 else data_parallel.bitmask_in_rank_order(mask, plan, self.ranks, shape.num_rows)
        key = (rows, shape.num_drafts)  # (confidence scheduling runs plain steps too)
        if key not in self._unconstrained:
            self._unconstrained[key] = jnp.full((rows, shape.num_drafts + 1, self.bitmask_words), -1, jnp.int32)
        return self._unconstrained[key]

    def _apply_cache_ops(self, plan: StepPlan) -> None:
        """The plan's prefix-cache operations (snapshots, restores, page copies), dispatched before its step."""
        if plan.cache:
            self.prefix.take(plan)

    @staticmethod
    def _drafts_read(plan: StepPlan) -> None:
        """The drafts a row took from its step in flight, now that it is read (the grammar masks
        along them need them on the host; the device already read its own copy)."""
        for req, _ in plan.scheduled:
            drafts = plan.drafts.get(req.request_id)
            if drafts and drafts[0] is None:
                known = req.drafts[: len(drafts)] if not req.is_finished else []
                plan.drafts[req.request_id] = known + [None] * (len(drafts) - len(known))

    @staticmethod
    def _masks_needed(plan: StepPlan) -> bool:
        return any(r.grammar is not None and plan.samples(r) for r, _ in plan.scheduled)

    def _process(self, plan: StepPlan, *outputs) -> list[Request]:
        """Read a step's results (waits for that step only) and record them: step_results.py."""
        return read_step(self, plan, *outputs)

    def step(self) -> list[Request]:
        """Schedule and dispatch one step; record the previous one (overlap) or this one.
        Returns the requests that finished; ``self.updated`` lists those that got tokens.

        If the device step fails, the request(s) that make it fail finish with reason
        "error" (``req.error`` says why) and StepFailed is raised; every other request
        is kept and replays from its tokens (the engine state is rebuilt), and
        ``self.updated`` lists those that got tokens while the culprits were sought."""
        t_start = time.perf_counter()
        self.updated = []
        self.last_wait_s = 0.0  # time this step() waited for device results (the rest is host time)
        if self.warming is not None:
            warmup.follow_background(self)
        plan = self.scheduler.schedule()
        dispatched = None
        finished: list[Request] = []
        prev = self._inflight
        # with overlap, a step with constrained rows dispatches its model half first; its grammar
        # masks need step N's tokens, so only the sampling half waits until step N is read
        split = self.overlap and self._masks_needed(plan)
        try:
            if split:
                shape = self._shape_for(plan)
                pending = self._run_forward(plan, shape)
            elif plan.scheduled:
                dispatched = (plan, *self._run(plan, self._dispatch_shape(plan)))
            if plan.scheduled:
                self.num_steps += plan.burst
            else:
                self._apply_cache_ops(plan)  # snapshots of requests that just left must not wait
            if self.overlap:
                self._inflight = None
                if prev is not None:
                    finished = self._process(*prev)
                if split:
                    self._drafts_read(plan)
                self._inflight = (plan, *self._run_sample(plan, shape, pending)) if split else dispatched
            elif dispatched is not None:
                finished = self._process(*dispatched)
        except Exception as exc:
            plans = [plan] + ([prev[0]] if prev is not None else [])
            # fail only the requests that make the step fail; the others replay (runtime/recovery.py)
            raise StepFailed(exc, recovery.isolate(self, plans, exc)) from exc
        if self.config.check_invariants:
            self.scheduler.check_invariant()
        if not self.has_unfinished:
            self.idle.set()
        now = time.perf_counter()
        self.last_host_s = now - t_start - self.last_wait_s
        self.host_s += self.last_host_s
        read = prev if self.overlap else dispatched
        if read is not None and read[0].cost_key and plan.scheduled and hasattr(self.scheduler.step_cost, "observe"):
            # a busy loop's step() lasts one step of the loop (with overlap: while the step read here
            # finishes): what confidence scheduling should price that step's kind at (step_cost.py)
            self.scheduler.step_cost.observe(read[0].cost_key, now - t_start)
        # (a step read now is progress: a request waiting for it is planned next time)
        if dispatched is None and self._inflight is None and prev is None and self.scheduler.has_unfinished:
            raise RuntimeError("scheduler made no progress: a request cannot fit the KV pools")
        return finished

    def bucket_shapes(self) -> list[PlanShape]:
        """Every step shape the engine can run: each token bucket with its row bucket (buckets.py; with
        confidence scheduling, each also without speculation), the decode bursts' (if on), then the
        decode-sized ones again with narrower block tables (context_widths.py)."""
        varlen = self.num_drafts > 0 and self.config.mtp_varlen
        kinds = [(self.num_drafts, varlen)] + ([(0, False)] if varlen else [])  # varlen: plain steps too
        base = [PlanShape(t, rows_for(t, self.row_buckets), self.max_pages, k, v) for k, v in kinds
                for t in self.token_buckets] + burst_dispatch.shapes(self)
        return base + context_widths.narrow_shapes(self, base)  # narrower block tables for decode steps

    def warmup(self, progress=None, background: bool = False, begin: bool = True) -> int:
        """Compile every bucket shape's step (``progress(1)`` after each), or with ``background`` one
        now and the rest on a worker thread while serving (``warming``; ``begin=False``: started by
        ``warming.begin()``); time confidence scheduling's cost model. Returns how many compiled now."""
        return warmup.warm_up(self, progress, background, begin)

    def ready_token_buckets(self) -> tuple[int, ...]:
        """Token buckets whose programs may be dispatched now (all, or those a background warm-up finished)."""
        return self.token_buckets if self.warming is None else self.warming.ready_tokens()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up has compiled every program; True when none is left."""
        return warmup.wait_background(self, timeout)

    def run_until_done(self) -> None:
        while self.has_unfinished:
            self.step()

    def check_all_free(self) -> None:
        self.scheduler.check_all_free()
