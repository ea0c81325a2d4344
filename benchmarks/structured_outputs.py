"""Structured outputs: what constraining costs. One workload, 0 %, 50 % and 100 % of its requests
constrained by a JSON schema, measured side by side in one run (rounds interleaved, best of them).

    python benchmarks/structured_outputs.py [--requests 16] [--new-tokens 64] [--rounds 3]

The bundled deepinfer-tiny-v4 through LLMEngine (overlap on, its default: while a constrained
request runs the steps do not overlap, and that cost is part of what is measured). Greedy
requests with ignore_eos for the free ones; a constrained one ends where its JSON closes, so
throughput is output tokens per second and ms per step (all rows decoding), not wall time.
Also: the schema's compile time cold (a fresh compiler, median of 5) and cached, and the host
time filling masks per step that has constrained rows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.default_model import default_model_dir  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.grammar.backend import GrammarBackend  # noqa: E402
from deepinfer.grammar.spec import StructuredOutputsParams  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402
from deepinfer.text.tokenizer import TextTokenizer  # noqa: E402

# an order line: long enough to keep a request constrained for most of --new-tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 16},
        "items": {"type": "array", "minItems": 3, "maxItems": 6, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"]}},
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "express"],
}


def run(engine, tok, n: int, share: float, new_tokens: int) -> dict:
    spec = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=new_tokens, structured_outputs=spec)
    n_constrained = round(n * share)
    reqs = [engine.add_request(tok.encode(f"<｜User｜>Order number {i}, as JSON.<｜Assistant｜>"),
                               constrained if i < n_constrained else free) for i in range(n)]
    fill0, steps0 = engine.mask_fill_s, engine.num_steps
    t0 = time.perf_counter()
    step_times = []
    while engine.has_unfinished:
        ts = time.perf_counter()
        engine.step()
        if all(r.num_computed > len(r.prompt_token_ids) for r in reqs) and len(engine.scheduler.running) == n:
            step_times.append(time.perf_counter() - ts)  # a decode step with every row in it
    dt = time.perf_counter() - t0
    out = sum(len(r.output_token_ids) for r in reqs)
    steps = engine.num_steps - steps0
    return {"share": share, "tok_s": out / dt, "ms_per_full_step": 1e3 * statistics.median(step_times) if step_times else None,
            "mask_fill_ms_per_step": 1e3 * (engine.mask_fill_s - fill0) / steps if n_constrained else 0.0,
            "stop": sum(r.finish_reason == "stop" for r in reqs[:n_constrained]), "constrained": n_constrained}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "structured_outputs.json"))
    args = ap.parse_args()
    cfg, params = load_checkpoint(default_model_dir())
    tok = TextTokenizer.from_dir(default_model_dir())
    spec = StructuredOutputsParams(json=SCHEMA)
    cold = []
    for _ in range(5):  # a fresh backend each time: nothing cached
        b = GrammarBackend(default_model_dir(), cfg.vocab_size, cfg.eos_token_ids)
        b.compile(StructuredOutputsParams(regex="warm"))  # xgrammar's import and the vocabulary scan, not timed
        t = time.perf_counter()
        b.compile(spec)
        cold.append(time.perf_counter() - t)
    backend = b
    t = time.perf_counter()
    backend.compile(spec)
    cached = time.perf_counter() - t
    engine = LLMEngine(cfg, params, EngineConfig(max_num_seqs=args.requests, max_num_batched_tokens=256, max_model_len=512,
                                                 warm_structured=True),
                       grammar=backend)
    engine.warmup()
    run(engine, tok, args.requests, 1.0, 8)  # first-use costs out of the way
    best: dict[float, dict] = {}
    for _ in range(args.rounds):
        for share in (0.0, 0.5, 1.0):
            r = run(engine, tok, args.requests, share, args.new_tokens)
            if share not in best or r["tok_s"] > best[share]["tok_s"]:
                best[share] = r
    base = best[0.0]
    print(f"compile cold {1e3 * statistics.median(cold):.2f} ms (median of 5), cached {1e3 * cached:.3f} ms")
    print(f"{'constrained':>11} {'tok/s':>8} {'cost x':>7} {'ms/full step':>13} {'step cost x':>12} {'mask fill ms/step':>18} stop")
    for share, r in best.items():
        r["cost_ratio"] = base["tok_s"] / r["tok_s"]
        r["step_cost_ratio"] = r["ms_per_full_step"] / base["ms_per_full_step"] if r["ms_per_full_step"] else None
        print(f"{share:>10.0%} {r['tok_s']:>8.1f} {r['cost_ratio']:>7.3f} {r['ms_per_full_step'] or 0:>13.2f} "
              f"{r['step_cost_ratio'] or 0:>12.3f} {r['mask_fill_ms_per_step']:>18.3f} {r['stop']}/{r['constrained']}")
    write_record({"benchmark": "structured_outputs", "model": "deepinfer-tiny-v4", "requests": args.requests,
                  "new_tokens": args.new_tokens, "compile_cold_ms": 1e3 * statistics.median(cold),
                  "compile_cached_ms": 1e3 * cached, "results": list(best.values())}, args.out)


if __name__ == "__main__":
    main()
