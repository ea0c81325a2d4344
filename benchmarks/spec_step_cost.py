"""Device time per step of the speculating program by draft depth and sampling-grid width, beside
the plain program, at a few step shapes (what confidence scheduling's cost model is built from).

    python benchmarks/spec_step_cost.py [--rounds 4] [--one-request]

The bundled model, engines shaped as spec_decode.py's at c = 16 (16 slots, 256-token steps):
k = 0 and k = 5 with mtp_varlen. Each figure is runtime/warmup.time_step (a padding-only plan, one
row made to sample; 5 steps dispatched back to back, the mean per step), the fastest of --rounds,
the settings interleaved so noise hits all alike.

``--one-request``: what one request's verification step (k drafts, k + 1 tokens) costs at c = 1,
in the program the engine runs it in (its token bucket's row bucket: k + 1 rows) and in a one-row
program of the same tokens, with and without drafting further, beside plain steps of 1, 2 and 4
tokens (engines of 4 slots, k = 0, 1, 3; 20 steps per timing).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepinfer.default_model import default_model_dir  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.models.deepseek_v4.loader import load_checkpoint  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.runtime.warmup import time_step  # noqa: E402
from deepinfer.scheduler.plan import PlanShape  # noqa: E402

SHAPES = [(16, 4), (16, 16), (32, 16), (64, 16)]  # (tokens, rows)
SETTINGS = {0: [(1, 1)], 5: [(0, 1), (1, 1), (3, 1), (5, 1), (1, 2), (1, 4), (1, 6)]}  # k: (depth, width)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--one-request", action="store_true", help="one request's verification step by row bucket")
    args = ap.parse_args()
    cfg, params = load_checkpoint(default_model_dir())
    if args.one_request:
        return one_request(cfg, params, args.rounds)
    engines = {}
    for k in SETTINGS:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        ec = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, speculative_config=spec,
                          mtp_varlen=bool(k))
        engines[k] = LLMEngine(cfg, params, ec)
    runs = [(k, e, s, d, w) for k, e in engines.items() for s in e.bucket_shapes()
            if (s.num_tokens, s.num_rows) in SHAPES for d, w in SETTINGS[k]]
    for k, e, s, d, w in runs:  # compile
        time_step(e, s, d, w, 1)
    best = {}
    for _ in range(args.rounds):
        for k, e, s, d, w in runs:
            key = (s.num_tokens, s.num_rows, k, d, w)
            best[key] = min(best.get(key, float("inf")), time_step(e, s, d, w, 5))
    print(f"{'tokens':>6} {'rows':>4} {'k':>2} {'depth':>5} {'width':>5} {'ms':>7}")
    for (t, r, k, d, w), v in sorted(best.items()):
        print(f"{t:>6} {r:>4} {k:>2} {d if k else '-':>5} {w:>5} {1e3 * v:>7.2f}")


def one_request(cfg, params, rounds: int) -> None:
    engines = {}
    for k in (0, 1, 3):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        engines[k] = LLMEngine(cfg, params, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
                                                         speculative_config=spec))
    pages = engines[0].max_pages
    runs = [(0, PlanShape(t, r, pages), 0, 1) for t, r in ((1, 1), (2, 2), (2, 1), (4, 4), (4, 1))]
    for k in (1, 3):  # k + 1 rows (the engine's bucket) and one row; drafting k further, and not drafting
        runs += [(k, PlanShape(k + 1, rows, pages, k), depth, k + 1) for rows in (k + 1, 1) for depth in (k, 0)]
    for k, shape, depth, width in runs:  # compile
        time_step(engines[k], shape, depth, width, 1)
    best = {}
    for _ in range(rounds):
        for k, shape, depth, width in runs:
            key = (k, shape.num_tokens, shape.num_rows, depth, width)
            best[key] = min(best.get(key, float("inf")), time_step(engines[k], shape, depth, width, 20))
    print(f"{'k':>2} {'tokens':>6} {'rows':>4} {'depth':>5} {'width':>5} {'ms':>7}")
    for (k, t, r, d, w), v in best.items():
        print(f"{k:>2} {t:>6} {r:>4} {d:>5} {w:>5} {1e3 * v:>7.2f}")


if __name__ == "__main__":
    main()
