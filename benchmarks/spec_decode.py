"""MTP speculative decoding: decode throughput and mean accepted length, speculation off vs on.

    python benchmarks/spec_decode.py [--concurrency 1,4,16,64] [--ks 0,1,3,5] [--new-tokens 64]

The bundled deepinfer-tiny-v4 (its MTP block is trained). For each concurrency c: c greedy
requests (random-token prompts of --prompt-len tokens; the greedy continuation soon becomes
the model's own text), run to completion through LLMEngine with speculation off (k = 0),
with k drafts per decode row, and confidence-scheduled ("var": up to 5 drafts, as many per
request as the drafter's confidence and the measured step costs make worth verifying);
every setting is measured in this one run, each engine warmed up first, the workload run
--rounds times on it, and again until --min-seconds have passed (the fastest round counts: this machine is noisy). A setting's rounds alternate
with rounds of speculation off on a warm engine kept beside it, and its speedup is its fastest round
over off's fastest of those same rounds ("off tok/s" beside it): this machine's speed drifts by tens
of percent over minutes, which a ratio of engines measured one after the other reads as speedup. Decode tok/s counts
the output tokens after each request's first, over the time from the last first token to the end. Mean
accepted length = tokens emitted per verified row (1 + accepted drafts). Also checks that
every stream equals speculation off.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.default_model import default_model_dir  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402


def make_engine(cfg, params, k: str, max_seqs: int, buckets=None) -> LLMEngine:
    drafts = 5 if k == "var" else int(k)
    spec = {"method": "mtp", "num_speculative_tokens": drafts} if drafts else None
    budget = max(buckets) if buckets else max(256, 8 * max_seqs)
    ec = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512,
                      speculative_config=spec, mtp_varlen=k == "var", token_buckets=buckets)
    engine = LLMEngine(cfg, params, ec)
    engine.warmup()
    return engine


def one_round(engine: LLMEngine, prompts, new_tokens: int) -> tuple[float, int, list]:
    """The workload once on a warm engine -> (decode tok/s, steps from the last first token, streams)."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    while any(not r.output_token_ids or r.output_token_ids[0] is None for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    steps0 = engine.num_steps
    counted = sum(len(r.output_token_ids) for r in reqs)
    engine.run_until_done()
    dt = time.perf_counter() - t0
    decoded = sum(len(r.output_token_ids) for r in reqs) - counted
    return decoded / dt, engine.num_steps - steps0, [r.output_token_ids for r in reqs]


def summary(engine: LLMEngine, k: str, best: float, steps: int) -> dict:
    stats = engine.stats()
    return {
        "k": k, "decode_tok_s": round(best, 1), "steps": steps,
        "mean_accepted_len": round(1 + stats.num_accepted_tokens / stats.num_drafts, 3) if stats.num_drafts else None,
        "accepted_per_position": [round(a / stats.num_drafts, 3) for a in stats.accepted_per_position] if stats.num_drafts else [],
    }


def rounds_of(rounds: int, min_seconds: float):
    """Round numbers until at least ``rounds`` ran and ``min_seconds`` passed: at low concurrency a round
    lasts ~50 ms, where one hiccup of this machine moves a best-of-3 by a quarter."""
    t0, i = time.perf_counter(), 0
    while i < rounds or time.perf_counter() - t0 < min_seconds:
        yield i
        i += 1


def paired(cfg, params, k: str, base: LLMEngine, prompts, new_tokens: int, max_seqs: int, rounds: int,
           min_seconds: float, buckets=None) -> tuple[dict, float, list]:
    """Setting k against speculation off, their rounds alternating on two warm engines (this machine drifts
    by tens of percent over minutes, so a ratio of two engines measured minutes apart is mostly that drift):
    (k's figures with its speedup = best round over off's best round among the same rounds, off's best
    round then, k's streams)."""
    engine = make_engine(cfg, params, k, max_seqs, buckets)
    best = best_off = 0.0
    for _ in rounds_of(rounds, min_seconds):
        best_off = max(best_off, one_round(base, prompts, new_tokens)[0])
        rate, n, streams = one_round(engine, prompts, new_tokens)
        if rate > best:
            best, steps = rate, n
    r = summary(engine, k, best, steps)
    r["speedup"] = round(best / best_off, 3)
    return r, best_off, streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--ks", default="0,1,3,5,var", help="drafts per decode row; 0: off; var: confidence-scheduled")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="workload repeats per engine; the fastest counts")
    ap.add_argument("--min-seconds", type=float, default=5.0, help="repeat rounds until this long has passed")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "spec_decode.json"))
    ap.add_argument("--token-buckets", help="e.g. 8,32: compile only these step sizes (the largest is the token "
                    "budget); for a GPU, where each program compiles for long")
    args = ap.parse_args()
    buckets = tuple(int(x) for x in args.token_buckets.split(",")) if args.token_buckets else None
    cfg, params = load_checkpoint(default_model_dir(), mtp="require")
    rng = np.random.default_rng(0)
    results = []
    print(f"{'conc':>5} {'k':>3} {'decode tok/s':>13} {'off tok/s':>10} {'speedup':>8} {'accepted len':>13} {'steps':>6}  per-position acceptance")
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [rng.integers(3, cfg.vocab_size, args.prompt_len).tolist() for _ in range(c)]
        base = make_engine(cfg, params, "0", max(c, 4), buckets)
        best_off, off_steps, off_streams = max(one_round(base, prompts, args.new_tokens)
                                               for _ in rounds_of(args.rounds, args.min_seconds))
        rows = [dict(summary(base, "0", best_off, off_steps), speedup=1.0, streams=off_streams)]
        for i, k in enumerate(k for k in args.ks.split(",") if k != "0"):
            if i:  # the last pairing's clear_caches (below) freed the off engine's programs too
                base.warmup()
            r, paired_off, streams = paired(cfg, params, k, base, prompts, args.new_tokens, max(c, 4), args.rounds,
                                           args.min_seconds, buckets)
            r["off_tok_s_alongside"] = round(paired_off, 1)
            r["streams"] = streams
            rows.append(r)
            # free this engine's programs: XLA CPU maps ~900 regions per compiled program and a run of
            # many engines otherwise exhausts vm.max_map_count (65530), failing with "Cannot allocate memory"
            gc.collect()
            jax.clear_caches()
        for r in rows:
            r["equal_to_off"] = r["streams"] == off_streams
            r["concurrency"] = c
            print(f"{c:>5} {r['k']:>3} {r['decode_tok_s']:>13} {r.get('off_tok_s_alongside', '-')!s:>10} "
                  f"{r['speedup']!s:>8} {r['mean_accepted_len']!s:>13} {r['steps']:>6}  {r['accepted_per_position']} "
                  f"{'' if r['equal_to_off'] else 'STREAMS DIFFER'}", flush=True)
        results.extend(rows)
        del base
        gc.collect()
        jax.clear_caches()
    for r in results:
        del r["streams"]
    write_record({"benchmark": "spec_decode", "model": "deepinfer-tiny-v4", "new_tokens": args.new_tokens,
                  "prompt_len": args.prompt_len, "results": results}, args.out)


if __name__ == "__main__":
    main()
