"""Offline engine throughput, and engine decode speed against the fused on-device generate().

    python benchmarks/offline_throughput.py [--num-prompts 64] [--models tiny,mid]

1. Offline: ``--num-prompts`` requests (fixed seed) with prompt lengths uniform in
   [--min-prompt, --max-prompt] and max_tokens uniform in [--min-out, --max-out],
   greedy, ignore_eos, run through LLMEngine after warm-up. Prints requests/s and
   output tokens/s.
2. Loop efficiency: the same batch (--batch requests, prompt --prompt-len, N new
   tokens) through the engine (overlap on, then off) and through
   deepinfer.generate(); decode rate = batch * (N - 1) / (T(N) - T(1)) for each,
   measured in this one run; prints the ratio engine / generate.
Prints a table and one JSON record. Random weights (configs/tiny_mixed.json, configs/mid.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import deepinfer  # noqa: E402
from benchmarks.timing import best_time  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.engine.sampling_params import SamplingParams  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.params import init_params  # noqa: E402
from deepinfer.runtime.engine import EngineConfig, LLMEngine  # noqa: E402

CONFIGS = {"tiny": "tiny_mixed.json", "mid": "mid.json"}


def offline(cfg, params, args) -> dict:
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_prompts)
    outs = rng.integers(args.min_out, args.max_out + 1, args.num_prompts)
    ec = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=args.max_prompt + args.max_out + 1,
        page_size=16, token_buckets=(16, 64, 256), row_buckets=(16,),
    )
    engine = LLMEngine(cfg, params, ec)
    t = time.perf_counter()
    programs = engine.warmup()
    warm = time.perf_counter() - t
    for n, m in zip(lens, outs):
        engine.add_request(rng.integers(2, cfg.vocab_size, n).tolist(), SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True))
    t = time.perf_counter()
    engine.run_until_done()
    elapsed = time.perf_counter() - t
    engine.check_all_free()
    return {
        "requests": args.num_prompts, "prompt_tokens": int(lens.sum()), "output_tokens": int(outs.sum()),
        "seconds": round(elapsed, 3), "requests_per_s": round(args.num_prompts / elapsed, 2),
        "output_tokens_per_s": round(outs.sum() / elapsed, 1), "steps": engine.num_steps,
        "programs": programs, "warmup_s": round(warm, 1), 
    }




def loop_efficiency(cfg, params, args, overlap: bool) -> dict:
    b, plen, n = args.batch, args.prompt_len, args.new_tokens
    prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (b, plen))
    ec = EngineConfig(max_num_seqs=b, max_num_batched_tokens=b * plen, max_model_len=plen + n + 1, page_size=16,
                      token_buckets=(b, b * plen), row_buckets=(b,), overlap=overlap)
    engine = LLMEngine(cfg, params, ec)
    engine.warmup()

    def run_engine(k):
        for p in prompts:
            engine.add_request(p.tolist(), SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
        engine.run_until_done()

    def run_fused(k):
        jax.block_until_ready(deepinfer.generate(cfg, params, prompts, max_new_tokens=k, eos_token_ids=()).tokens)

    run_fused(n), run_fused(1), run_engine(2)
    e_rate = b * (n - 1) / max(best_time(lambda: run_engine(n)) - best_time(lambda: run_engine(1)), 1e-9)
    g_rate = b * (n - 1) / max(best_time(lambda: run_fused(n)) - best_time(lambda: run_fused(1)), 1e-9)
    engine.check_all_free()
    return {"batch": b, "new_tokens": n, "overlap": overlap, "engine_decode_tok_s": round(e_rate, 1),
            "generate_decode_tok_s": round(g_rate, 1), "ratio": round(e_rate / g_rate, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--min-out", type=int, default=8)
    ap.add_argument("--max-out", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-offline", action="store_true", help="only the loop-efficiency part")
    args = ap.parse_args()
    record = {"device": jax.devices()[0].device_kind, "results": []}
    for name in args.models.split(","):
        cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", CONFIGS[name]))
        params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(0))
        result = {"model": name}
        if not args.skip_offline:
            off = result["offline"] = offline(cfg, params, args)
            print(f"{name}: {off['requests']} requests ({off['prompt_tokens']} prompt + {off['output_tokens']} output tokens) "
                  f"in {off['seconds']} s: {off['requests_per_s']} req/s, {off['output_tokens_per_s']} output tok/s "
                  f"({off['steps']} steps, {off['programs']} programs, warm-up {off['warmup_s']} s)", flush=True)
        result["loop_efficiency"] = []
        for overlap in (True, False):
            eff = loop_efficiency(cfg, params, args, overlap)
            result["loop_efficiency"].append(eff)
            print(f"{name}: decode at batch {eff['batch']}, overlap {'on ' if overlap else 'off'}: engine "
                  f"{eff['engine_decode_tok_s']} tok/s, fused generate() {eff['generate_decode_tok_s']} tok/s, "
                  f"ratio {eff['ratio']}", flush=True)
        record["results"].append(result)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
