"""The needle test, run as its own process (the mode needs an XLA flag before JAX starts):

    DEEPINFER_BATCH_INVARIANT=1 python -m tests.needle_batch_invariance --trials 24

A fixed prompt ("the needle") runs alone, then inside random batches: 1-7 random
other prompts, random arrival steps, and two engines whose token budgets (32
and 13) chunk prefills differently. For greedy and for seeded sampling the
needle's tokens and log-probabilities (sampled + top-5) must be bitwise those of
the alone run. Done with the mode on and off in one process; prints one JSON
line: per mode, how many trials differed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import deepinfer  # noqa: F401  (first: configures XLA for the mode)
import jax
import numpy as np

from deepinfer import SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.params import init_params
from deepinfer.runtime.engine import EngineConfig, LLMEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDLE_PARAMS = {
    "greedy": dict(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True),
    "seeded": dict(temperature=0.9, top_p=0.95, seed=77, max_tokens=10, logprobs=5, ignore_eos=True),
}


def engines(cfg, params, invariant: bool):
    base = dict(max_num_seqs=8, max_model_len=96, page_size=4, row_buckets=(4, 8), batch_invariant=invariant)
    return [
        LLMEngine(cfg, params, EngineConfig(max_num_batched_tokens=32, token_buckets=(8, 16, 32), **base)),
        LLMEngine(cfg, params, EngineConfig(max_num_batched_tokens=13, token_buckets=(8, 16), **base)),
    ]


def result(req):
    return req.output_token_ids, [req.token_logprobs[i] for i in range(len(req.output_token_ids))]


def run_mode(cfg, params, invariant: bool, trials: int) -> dict:
    engs = engines(cfg, params, invariant)
    rng = np.random.default_rng(1234)
    needle = rng.integers(0, cfg.vocab_size, 21).tolist()
    alone = {}
    for kind, kw in NEEDLE_PARAMS.items():
        req = engs[0].add_request(needle, SamplingParams(**kw))
        engs[0].run_until_done()
        alone[kind] = result(req)
    differing, token_mismatch = 0, 0
    for trial in range(trials):
        kind = list(NEEDLE_PARAMS)[trial % 2]
        eng = engs[(trial // 2) % 2]
        others = [rng.integers(0, cfg.vocab_size, int(rng.integers(1, 40))).tolist() for _ in range(int(rng.integers(1, 8)))]
        early = int(rng.integers(0, len(others) + 1))
        other_sp = lambda: SamplingParams(temperature=float(rng.choice([0, 1.0])), seed=int(rng.integers(0, 2**31)),  # noqa: E731
                                          max_tokens=int(rng.integers(1, 16)), ignore_eos=True)
        for o in others[:early]:
            eng.add_request(o, other_sp())
        for _ in range(int(rng.integers(0, 4))):
            eng.step()
        req = eng.add_request(needle, SamplingParams(**NEEDLE_PARAMS[kind]))
        for o in others[early:]:
            eng.add_request(o, other_sp())
        eng.run_until_done()
        eng.check_all_free()
        got = result(req)
        differing += got != alone[kind]
        token_mismatch += got[0] != alone[kind][0]
    return {"trials": trials, "differing": differing, "token_mismatch": token_mismatch}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--modes", default="on,off")
    args = ap.parse_args()
    cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", "tiny_mixed.json"))
    params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(3))
    params["head"] = params["head"] * 40.0  # a peaked distribution, as in the default model
    out = {mode: run_mode(cfg, params, mode == "on", args.trials) for mode in args.modes.split(",")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
