"""What one step program costs to build: tracing, lowering and XLA's compile, the program's size,
and which source lines contribute most of its operations.

    python benchmarks/compile_cost.py [--shapes 1x1,16x16] [--max-model-len 1024] [--max-num-seqs 16]
                                      [--sources 20] [--run 20] [--in-loop]

Loads the default model through ``LLM()`` (nothing compiled), then for each TOKENSxROWS step shape
lowers and compiles the engine's paged step from abstract arguments (what the background warm-up
does) and times each phase. ``--sources N`` prints the N source lines with the most jaxpr
equations (loops unrolled in Python show up here), ``--run N`` times N dispatches of the compiled
step on an empty plan (device ms per step), ``--in-loop`` also the time per iteration of the same
step inside one program (decode bursts of 2 and 9 steps: (T9 - T2) / 7), and of ``generate()``'s
loop on the same weights (batch 1, 32-token prompt). Kernels follow DEEPINFER_KERNELS and the platform, as in
the engine; XLA_FLAGS apply. Writes benchmarks/results/compile_cost.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import best_time, write_record  # noqa: E402
from deepinfer.llm import LLM  # noqa: E402
from deepinfer.runtime.ahead_of_time import abstract  # noqa: E402
from deepinfer.runtime.paged_step import paged_step, paged_step_jit, step_program  # noqa: E402
from deepinfer.runtime.step_program import abstract_inputs  # noqa: E402
from deepinfer.scheduler.plan import PlanShape  # noqa: E402


def equations_by_source(engine, shape: PlanShape, top: int) -> tuple[int, list]:
    """(total jaxpr equations, the ``top`` source lines with most of them), sub-jaxprs (loop bodies,
    conditionals, kernels) counted once each, as XLA sees them."""
    from jax._src import core, source_info_util

    def step(p, s, i, f, b):
        return paged_step(engine.family, engine.cfg, engine.layout, shape, p, s, i, f, b)

    closed = jax.make_jaxpr(step)(abstract(engine.params), abstract(engine.state), *abstract_inputs(engine, shape))
    counts: collections.Counter = collections.Counter()

    def inner(v):
        if isinstance(v, core.ClosedJaxpr):
            return [v.jaxpr]
        if isinstance(v, core.Jaxpr):
            return [v]
        if isinstance(v, (list, tuple)):
            return [j for x in v for j in inner(x)]
        return []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            subs = [j for v in eqn.params.values() for j in inner(v)]
            for sub in subs:
                walk(sub)
            if subs:
                continue
            where = "(jax internals)"
            for frame in source_info_util.user_frames(eqn.source_info.traceback) if eqn.source_info.traceback else ():
                if "deepinfer" in frame.file_name or "pallas_kernels" in frame.file_name:
                    where = f"{os.path.relpath(frame.file_name, ROOT)}:{frame.start_line} {frame.function_name}"
                    break
            counts[where] += 1

    walk(closed.jaxpr)
    return sum(counts.values()), counts.most_common(top)


def time_dispatches(engine, shape: PlanShape, n: int, repeats: int = 1) -> float:
    """Milliseconds per dispatch of the step (or burst, ``shape.steps``) on an empty plan, state donated
    as in the engine: n dispatches back to back, the best of ``repeats``."""
    from deepinfer.scheduler.plan import pack
    from deepinfer.scheduler.step_plan import StepPlan
    import jax.numpy as jnp

    ints, floats = (jnp.asarray(a) for a in pack(StepPlan(), engine.pools, shape, engine.layout.num_slots, {},
                                                 engine.cfg.vocab_size))
    bitmask = engine._bitmask(StepPlan(), shape)
    program = step_program(shape)
    args = (engine.family, engine.cfg, engine.layout, shape, engine.params)
    state = engine.state

    def run(k, state):
        for _ in range(k):
            out, state = program(*args, state, ints, floats, bitmask)
        jax.block_until_ready(out)
        return state

    state = run(3, state)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state = run(n, state)
        best = min(best, (time.perf_counter() - t) / n)
    engine.state = state
    return 1e3 * best


def time_in_loop(engine, shape: PlanShape) -> dict:
    """Per-iteration milliseconds of the step inside one program (bursts of 2 and 9) and of
    ``generate()``'s loop at batch 1, measured side by side."""
    import dataclasses

    import numpy as np

    import deepinfer

    two, nine = (time_dispatches(engine, dataclasses.replace(shape, steps=k), 20, repeats=5) for k in (2, 9))
    prompts = np.random.default_rng(1).integers(2, engine.cfg.vocab_size, (1, 32))

    def gen(k):
        jax.block_until_ready(deepinfer.generate(engine.cfg, engine.params, prompts, max_new_tokens=k,
                                                 eos_token_ids=()).tokens)

    gen(33), gen(1)
    return {"in_burst_ms_per_step": round((nine - two) / 7, 3),
            "generate_ms_per_step": round(1e3 * (best_time(lambda: gen(33), 5) - best_time(lambda: gen(1), 5)) / 32, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint or config.json (default: the bundled model)")
    ap.add_argument("--shapes", default="1x1,16x16", help="TOKENSxROWS step shapes, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--in-loop", action="store_true", help="also time the step inside a loop, and generate()'s")
    ap.add_argument("--sources", type=int, default=0, help="print the N source lines with most equations")
    ap.add_argument("--run", type=int, default=0, help="time N dispatches of each compiled step")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compile_cost.json"))
    a = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(a.model, warmup=False, show_progress=False, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs)
    engine = llm.engine
    load_s = time.perf_counter() - t0
    print(f"platform {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
          f"model loaded in {load_s:.1f} s; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} "
          f"DEEPINFER_KERNELS={os.environ.get('DEEPINFER_KERNELS', '')!r}", flush=True)
    rows = []
    for spec in a.shapes.split(","):
        tokens, nrows = (int(x) for x in spec.split("x"))
        shape = PlanShape(tokens, nrows, engine.max_pages)
        args = (engine.family, engine.cfg, engine.layout, shape, abstract(engine.params), abstract(engine.state),
                *abstract_inputs(engine, shape))
        t = time.perf_counter()
        traced = paged_step_jit.trace(*args)
        trace_s = time.perf_counter() - t
        t = time.perf_counter()
        lowered = traced.lower()
        lower_s = time.perf_counter() - t
        ops = len(re.findall(r"= stablehlo\.", lowered.as_text()))
        print(f"{tokens}x{nrows}: traced {trace_s:.2f} s, lowered {lower_s:.2f} s ({ops} StableHLO ops); compiling ...",
              flush=True)
        t = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t
        text = compiled.as_text() or ""
        row = {"shape": spec, "trace_s": round(trace_s, 2), "lower_s": round(lower_s, 2),
               "compile_s": round(compile_s, 2), "stablehlo_ops": ops,
               "optimized_hlo_lines": text.count("\n"), "fusions": len(re.findall(r" fusion\(", text)),
               "while_loops": len(re.findall(r" while\(", text))}
        if a.run:
            row["ms_per_dispatch"] = round(time_dispatches(engine, shape, a.run, repeats=5), 3)
        if a.in_loop:
            row.update(time_in_loop(engine, shape))
        print(row, flush=True)
        if a.sources:
            total, top = equations_by_source(engine, shape, a.sources)
            row["jaxpr_equations"] = total
            row["top_sources"] = [[n, where] for where, n in top]
            print(f"{total} jaxpr equations; most from:")
            for where, n in top:
                print(f"  {n:6d}  {where}")
        rows.append(row)
    write_record({"benchmark": "compile_cost", "platform": jax.devices()[0].platform, "jax": jax.__version__,
                  "xla_flags": os.environ.get("XLA_FLAGS", ""), "kernels": os.environ.get("DEEPINFER_KERNELS", ""),
                  "max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs, "load_s": round(load_s, 2),
                  "rows": rows}, a.out)


if __name__ == "__main__":
    main()
