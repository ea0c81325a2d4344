"""Step time with the dense projections stored [out, in] (the checkpoint's layout) against [in, out]
(what the engine stores on a CPU: models/deepseek_v4/weight_layout.py), side by side in one process.

    python benchmarks/weight_layout.py [--drafts 0] [--rounds 5] [--repeats 20]

Two engines on the bundled model with the same settings, one given a family without
``compute_layout`` (so its weights stay as loaded); every (tokens, rows) step shape up to 32
tokens is timed with ``runtime.warmup.time_step`` (pipelined steps, the device's time per step),
the two engines alternating shape by shape, best of --rounds x --repeats. --drafts k: engines that
speculate k drafts, timed at drafter depth k (a speculative step: drafter loop and verification).
Also checks that one greedy request gets the same tokens from both.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepinfer.default_model import default_model_dir  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.models.deepseek_v4.family import DeepSeekV4  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.runtime.warmup import time_step  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402


@dataclasses.dataclass(frozen=True)
class CheckpointLayout(DeepSeekV4):
    """DeepSeek-V4 without a compute layout: the weights stay [out, in] on every platform."""

    compute_layout = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    cfg, params = load_checkpoint(default_model_dir(), mtp="require" if args.drafts else "skip")
    spec = {"method": "mtp", "num_speculative_tokens": args.drafts} if args.drafts else None
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=512, speculative_config=spec,
                          token_buckets=(1, 2, 4, 8, 16, 32, 256), row_buckets=(1, 4, 32))
    engines = {"[out, in]": LLMEngine(cfg, params, config, family=CheckpointLayout()),
               "[in, out]": LLMEngine(cfg, params, config)}
    tokens = {}
    for name, engine in engines.items():
        req = engine.add_request(list(range(5, 21)), SamplingParams(max_tokens=24, temperature=0.0), request_id="r")
        engine.run_until_done()
        tokens[name] = list(req.output_token_ids)
    first = next(iter(engines.values()))
    shapes = [s for s in first.bucket_shapes() if s.num_tokens <= 32 and s.steps == 1 and s.max_pages == first.max_pages]
    for engine in engines.values():
        for s in shapes:
            time_step(engine, s, args.drafts, 1, 2)  # compiled and warm
    best: dict = {}
    for _ in range(args.rounds):
        for s in shapes:
            for name, engine in engines.items():
                key = (name, s)
                best[key] = min(best.get(key, float("inf")), time_step(engine, s, args.drafts, 1, args.repeats))
    print(f"drafter depth {args.drafts}; greedy tokens equal: {tokens['[out, in]'] == tokens['[in, out]']}")
    print("| (tokens, rows) | [out, in] ms | [in, out] ms | ratio |")
    print("|---|---|---|---|")
    for s in shapes:
        a, b = best["[out, in]", s], best["[in, out]", s]
        print(f"| ({s.num_tokens}, {s.num_rows}) | {1e3 * a:.3f} | {1e3 * b:.3f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
