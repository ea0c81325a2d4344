"""deepinfer.generate() decode rate alone, for comparing two checkouts back to back.

    python benchmarks/generate_rate.py [CHECKOUT]     # CHECKOUT: a repo root (default: this one)

Random weights (configs/tiny_mixed.json, configs/mid.json), prompt 32, 32 new tokens, greedy,
batch 1 and 32; rate = B * (N - 1) / (T(N) - T(1)), best of 3 -- the generate() side of
loop_efficiency.py without the engine. Run it for an old checkout (``git worktree add``)
and for this one on an idle machine to see what a change did to the fused loop.
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import deepinfer  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.params import init_params  # noqa: E402


def main() -> None:
    out = {"checkout": ROOT}
    for name, fname in (("tiny", "tiny_mixed.json"), ("mid", "mid.json")):
        cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", fname))
        params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(0))
        for b in (1, 32):
            prompts = np.random.default_rng(1).integers(2, cfg.vocab_size, (b, 32))

            def best(n):
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    jax.block_until_ready(deepinfer.generate(cfg, params, prompts, max_new_tokens=n, eos_token_ids=()).tokens)
                    times.append(time.perf_counter() - t0)
                return min(times)

            best(1), best(32)  # compile both programs
            rate = b * 31 / (best(32) - best(1))
            out[f"{name} b{b}"] = round(rate, 1)
            print(f"{name} batch {b}: {rate:.1f} tok/s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
