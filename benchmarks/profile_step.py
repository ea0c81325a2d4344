"""Where a step's time goes: a JAX profiler trace of N engine steps, and a summary of it.

    python benchmarks/profile_step.py [--batch 1] [--steps 20] [--out /tmp/deepinfer-profile]

The bundled model through LLM() with its default settings (what users and the server get),
warmed up; then --batch requests decode while the profiler records --steps engine steps, each
inside a StepTraceAnnotation named "engine_step". Writes the trace (``*.xplane.pb`` for
TensorBoard / XProf, ``*.trace.json.gz`` for Perfetto or chrome://tracing) under --out and
prints, from the JSON trace: the wall time per step, and the events that take the most time
summed over the steps (host-side Python / dispatch events and the device's XLA ops both show
up: on a CPU the "device" is a thread pool of the same machine). BENCHMARKS.md §13 says how to
read it.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from deepinfer.llm import LLM  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402


def summarize(trace_dir: str, top: int) -> list[tuple[str, float, int]]:
    """(event name, total ms, count) of the trace's complete events, largest first."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    total, count = collections.Counter(), collections.Counter()
    for ev in events:
        if ev.get("ph") == "X" and "dur" in ev and not ev["name"].startswith("$profiler.py"):  # the profiler itself
            total[ev["name"]] += ev["dur"] / 1e3
            count[ev["name"]] += 1
    return [(name, ms, count[name]) for name, ms in total.most_common(top)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out", default="/tmp/deepinfer-profile")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    llm = LLM(show_progress=False)  # the defaults, warmed up
    engine = llm.engine
    sp = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([3 + (i + j) % 50 for j in range(args.prompt_len)], sp)
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill outside the trace: the trace is of decode steps
    walls = []
    jax.profiler.start_trace(args.out)
    try:
        for i in range(args.steps):
            with jax.profiler.StepTraceAnnotation("engine_step", step_num=i):
                t0 = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t0) * 1e3)
    finally:
        jax.profiler.stop_trace()
    while engine.has_unfinished:
        engine.step()
    walls.sort()
    print(f"# {jax.default_backend()}, batch {args.batch}, {args.steps} decode steps traced -> {args.out}")
    print(f"engine.step() wall ms: median {walls[len(walls) // 2]:.3f}, min {walls[0]:.3f}, max {walls[-1]:.3f}")
    print("| event | total ms | count | ms per step |")
    print("|---|---:|---:|---:|")
    for name, ms, n in summarize(args.out, args.top):
        print(f"| {name[:80]} | {ms:.2f} | {n} | {ms / args.steps:.3f} |")


if __name__ == "__main__":
    main()
