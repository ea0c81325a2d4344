"""Offline engine throughput on a fixed synthetic workload.

    python benchmarks/offline_throughput.py [--models tiny,mid,bundled] [--num-prompts 256] [--engine-defaults]

--num-prompts requests (seed 0) with prompt lengths uniform in [--min-prompt,
--max-prompt] (default 32-512) and max_tokens uniform in [--min-out, --max-out]
(default 16-256), greedy, ignore_eos, all queued at once and run through
LLMEngine after warm-up (16 sequences, 256-token steps). Prints requests/s,
output tokens/s and total tokens/s, host/device time per step and the
device-busy fraction; one JSON record, also written to
benchmarks/results/offline_throughput.json. Random weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.default_model import default_model_dir  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.params import init_params  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {"tiny": "tiny_mixed.json", "mid": "mid.json"}  # random weights; "bundled": deepinfer-tiny-v4


def load_model(name: str):
    if name == "bundled":
        return load_checkpoint(default_model_dir(), dtype="float32", mtp="skip")
    cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", CONFIGS[name]))
    return cfg, init_params(model_spec(cfg, include_mtp=False), jax.random.key(0))


def offline(cfg, params, args) -> dict:
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_prompts)
    outs = rng.integers(args.min_out, args.max_out + 1, args.num_prompts)
    # --engine-defaults: the buckets LLM() and the server get; otherwise three token buckets, one row bucket
    buckets = {} if args.engine_defaults else dict(token_buckets=(16, 64, 256), row_buckets=(16,))
    ec = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=args.max_prompt + args.max_out + 1,
        page_size=16, measure_device=True, **buckets,
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
    engine.step_timer.drain()
    timing = engine.step_timer.summary()
    engine.check_all_free()
    return {
        "requests": args.num_prompts, "prompt_tokens": int(lens.sum()), "output_tokens": int(outs.sum()),
        "seconds": round(elapsed, 2), "requests_per_s": round(args.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(outs.sum() / elapsed, 1),
        "total_tokens_per_s": round((lens.sum() + outs.sum()) / elapsed, 1), "steps": engine.num_steps,
        "host_ms_per_step": round(1e3 * engine.host_s / engine.num_steps, 3),
        "device_ms_per_step_last_256": round(1e3 * timing["device_s_per_step"], 3),
        "device_busy_fraction_last_256": round(timing["busy_fraction"], 3),
        "programs": programs, "warmup_s": round(warm, 1), "preemptions": engine.scheduler.num_preemptions,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--engine-defaults", action="store_true", help="the default EngineConfig buckets (as LLM() and the server)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "offline_throughput.json"))
    args = ap.parse_args()
    record = {"benchmark": "offline_throughput", "device": jax.devices()[0].device_kind, "workload": {
        k: getattr(args, k) for k in ("num_prompts", "min_prompt", "max_prompt", "min_out", "max_out")}, "results": []}
    for name in args.models.split(","):
        cfg, params = load_model(name)
        off = {"model": name, **offline(cfg, params, args)}
        record["results"].append(off)
        print(f"{name}: {off['requests']} requests ({off['prompt_tokens']} prompt + {off['output_tokens']} output tokens) "
              f"in {off['seconds']} s: {off['requests_per_s']} req/s, {off['output_tokens_per_s']} output tok/s, "
              f"{off['total_tokens_per_s']} total tok/s; {off['steps']} steps, host {off['host_ms_per_step']} ms/step, "
              f"device busy {off['device_busy_fraction_last_256']} (last 256 steps); {off['programs']} programs, "
              f"warm-up {off['warmup_s']} s", flush=True)
    write_record(record, args.out)


if __name__ == "__main__":
    main()
