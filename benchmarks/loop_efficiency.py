"""Loop efficiency: engine decode throughput / fused on-device generate() throughput.

    python benchmarks/loop_efficiency.py [--models bundled,tiny,mid] [--batches 1,32] [--new-tokens 32]
                                         [--sized-buckets] [--decode-steps 1,4]
                                         [--max-model-len 16384] [--tables default,one,128]
                                         [--overlap on,off]

For each model and batch: the same requests (prompt --prompt-len, N new tokens,
greedy) through LLMEngine with overlap on, then off, and through
deepinfer.generate() (prefill + lax.while_loop, one program); decode rate =
batch * (N - 1) / (T(N) - T(1)), best of 3, all measured in this one run. Also
per step: host time, device time and device-busy fraction (runtime/step_timer.py).
The engine runs with the default settings of LLM() and the server (buckets, budget, max_model_len),
only max_num_seqs raised to the batch where it is larger than the default; --sized-buckets instead
gives it one token bucket of exactly the batch (the round-one setting, which hid the bucket cost).
--decode-steps: the engine's num_continuous_decode_steps values to measure, each its own rows (default:
the default setting's alone; scheduler/decode_burst.py). --max-model-len: the engine's (generate()
sizes its own to the requests); --tables default,one,128: with the engine's block-table widths by context,
with one width (max_model_len's), and with one narrow width for a 128-token context beside the full one,
each its own rows (runtime/context_widths.py).
Prints a table and one JSON record (also written to benchmarks/results/loop_efficiency.json).
The bundled trained model, or random weights (configs/tiny_mixed.json, configs/mid.json); CPU unless
a GPU is present.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import deepinfer  # noqa: E402
from benchmarks.timing import best_time, write_record  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.params import init_params  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {"tiny": "tiny_mixed.json", "mid": "mid.json"}


def load(name: str):
    """(config, params) of the bundled model or a random one."""
    if name == "bundled":
        from deepinfer.default_model import default_model_dir
        from deepinfer.model_loading import load_model

        return load_model(default_model_dir(), mtp="skip")
    cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", CONFIGS[name]))
    return cfg, init_params(model_spec(cfg, include_mtp=False), jax.random.key(0))


def context_buckets(tables: str) -> tuple[int, ...] | None:
    """EngineConfig.context_buckets for a --tables entry: default (None), one (no narrow widths) or a context
    in tokens (one narrow width for it beside the full one)."""
    if tables.isdigit():
        return (int(tables),)
    if tables not in ("default", "one"):
        raise SystemExit(f"--tables: {tables!r} is not default, one or a context in tokens")
    return None if tables == "default" else ()


def engine_config(batch: int, plen: int, n: int, overlap: bool, sized: bool, steps: int, max_model_len: int | None = None,
                  tables: str = "default") -> EngineConfig:
    if sized:  # round one's setting: buckets of exactly this batch
        return EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * plen, max_model_len=plen + n + 1,
                            page_size=16, token_buckets=(batch, batch * plen), row_buckets=(batch,), overlap=overlap,
                            measure_device=True, num_continuous_decode_steps=steps)
    defaults = EngineConfig()
    return EngineConfig(max_num_seqs=max(batch, defaults.max_num_seqs), overlap=overlap, measure_device=True,
                        num_continuous_decode_steps=steps, max_model_len=max_model_len or defaults.max_model_len,
                        context_buckets=context_buckets(tables))


def measure(cfg, params, batch: int, plen: int, n: int, overlap: bool, fused_rate: float, sized: bool,
            steps: int, max_model_len: int | None = None, tables: str = "default") -> dict:
    prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (batch, plen))
    engine = LLMEngine(cfg, params, engine_config(batch, plen, n, overlap, sized, steps, max_model_len, tables))
    engine.warmup()

    def run_engine(k):
        for p in prompts:
            engine.add_request(p.tolist(), SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))
        engine.run_until_done()

    run_engine(2)
    t1 = best_time(lambda: run_engine(1))
    engine.step_timer.drain()
    engine.step_timer.reset()
    steps0, host0 = engine.num_steps, engine.host_s
    tn = best_time(lambda: run_engine(n))
    engine.step_timer.drain()
    timing = engine.step_timer.summary()
    steps = engine.num_steps - steps0
    rate = batch * (n - 1) / max(tn - t1, 1e-9)
    engine.check_all_free()
    return {
        "batch": batch, "new_tokens": n, "overlap": overlap, "decode_steps": steps,
        "max_model_len": engine.config.max_model_len, "tables": "one width" if len(engine.context_widths) == 1 else
        f"{len(engine.context_widths)} widths", "engine_decode_tok_s": round(rate, 1),
        "generate_decode_tok_s": round(fused_rate, 1), "ratio": round(rate / fused_rate, 3),
        "host_ms_per_step": round(1e3 * (engine.host_s - host0) / steps, 3),
        "device_ms_per_step": round(1e3 * timing["device_s_per_step"], 3),
        "device_busy_fraction": round(timing["busy_fraction"], 3),
    }


def fused(cfg, params, batch: int, plen: int, n: int) -> float:
    prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (batch, plen))

    def run(k):
        jax.block_until_ready(deepinfer.generate(cfg, params, prompts, max_new_tokens=k, eos_token_ids=()).tokens)

    run(n), run(1)
    return batch * (n - 1) / max(best_time(lambda: run(n)) - best_time(lambda: run(1)), 1e-9)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,tiny,mid")
    ap.add_argument("--sized-buckets", action="store_true", help="one token bucket of exactly the batch (round one)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-steps", default=str(EngineConfig().num_continuous_decode_steps),
                    help="num_continuous_decode_steps values, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=None, help="the engine's (default: EngineConfig's)")
    ap.add_argument("--tables", default="default",
                    help="block-table widths to measure, comma-separated: default (the engine's context buckets), "
                         "one (one width, max_model_len's), or a context in tokens (one narrow width for it beside the full one; "
                         "runtime/context_widths.py)")
    ap.add_argument("--overlap", default="on,off", help="overlap settings to measure, comma-separated")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "loop_efficiency.json"))
    args = ap.parse_args()
    record = {"benchmark": "loop_efficiency", "device": jax.devices()[0].device_kind, "prompt_len": args.prompt_len,
              "buckets": "sized to the batch" if args.sized_buckets else "engine defaults",
              "new_tokens": args.new_tokens, "results": []}
    print(f"{'model':6} {'batch':>5} {'tables':>9} {'overlap':>7} {'steps':>5} {'engine tok/s':>12} {'generate tok/s':>14} {'ratio':>6} "
          f"{'host ms/step':>12} {'device ms/step':>14} {'busy':>5}")
    for name in args.models.split(","):
        cfg, params = load(name)
        for b in (int(x) for x in args.batches.split(",")):
            g = fused(cfg, params, b, args.prompt_len, args.new_tokens)
            for tables, steps, overlap in itertools.product(args.tables.split(","), (
                    int(x) for x in args.decode_steps.split(",")), (o == "on" for o in args.overlap.split(","))):
                r = {"model": name, **measure(cfg, params, b, args.prompt_len, args.new_tokens, overlap, g,
                                              args.sized_buckets, steps, args.max_model_len, tables)}
                record["results"].append(r)
                print(f"{name:6} {b:>5} {r['tables']:>9} {'on' if overlap else 'off':>7} {steps:>5} {r['engine_decode_tok_s']:>12} "
                      f"{r['generate_decode_tok_s']:>14} {r['ratio']:>6} {r['host_ms_per_step']:>12} "
                      f"{r['device_ms_per_step']:>14} {r['device_busy_fraction']:>5}", flush=True)
    write_record(record, args.out)


if __name__ == "__main__":
    main()
