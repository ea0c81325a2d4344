"""Where the engine's per-step time goes on XLA CPU: one program per step vs the same step in a loop,
and what the stored weight layout costs a matmul.

    python benchmarks/dispatch_cost.py [--model mid] [--batch 32]

1. The engine's paged decode step for --batch requests (prompt 32), timed as
   separate jitted calls with the state donated (how the engine runs it) and as
   iterations of one fori_loop program (4 iterations minus 1, best of 3).
2. x[batch, in] times a weight stored [out, in] (the model's layout, an einsum)
   vs stored [in, out] (x @ w), per call, for three weight shapes.
Prints a table and one JSON record (benchmarks/results/dispatch_cost.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.config import ModelConfig  # noqa: E402
from deepinfer.engine_config import EngineConfig  # noqa: E402
from deepinfer.models.deepseek_v4 import model_spec  # noqa: E402
from deepinfer.params import init_params  # noqa: E402
from deepinfer.runtime.engine import LLMEngine  # noqa: E402
from deepinfer.runtime.paged_step import paged_step, paged_step_jit  # noqa: E402
from deepinfer.scheduler.plan import PlanShape, pack  # noqa: E402
from deepinfer.scheduler.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {"tiny": "tiny_mixed.json", "mid": "mid.json"}


def step_cost(cfg, params, b: int) -> dict:
    ec = EngineConfig(max_num_seqs=b, max_num_batched_tokens=b * 32, max_model_len=80, token_buckets=(b, b * 32),
                      row_buckets=(b,), overlap=False)
    e = LLMEngine(cfg, params, ec)
    rng = np.random.default_rng(0)
    for _ in range(b):
        e.add_request(rng.integers(2, cfg.vocab_size, 32).tolist(), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    e.step(), e.step()  # prefill, then one decode: the state holds 33 tokens per request
    plan = e.scheduler.schedule()  # a decode-only step
    shape = PlanShape(b, b, e.max_pages)
    ints, floats = (jnp.asarray(a) for a in pack(plan, e.pools, shape, e.layout.num_slots, e._seeds,
                                                    cfg.vocab_size, cfg.eos_token_ids))
    bitmask = e._bitmask(plan, shape)  # all ones: nothing constrained

    def loop(params, state, k):
        body = lambda i, st: paged_step(e.family, cfg, e.layout, shape, params, st, ints, floats, bitmask)[1]  # noqa: E731
        return jax.lax.fori_loop(0, k, body, state)

    looped = jax.jit(loop, static_argnums=2)
    state = jax.tree.map(lambda a: a.copy(), e.state)
    for k in (1, 4):
        jax.block_until_ready(looped(params, state, k))
    t1 = min(timeit.repeat(lambda: jax.block_until_ready(looped(params, state, 1)), number=1, repeat=3))
    t4 = min(timeit.repeat(lambda: jax.block_until_ready(looped(params, state, 4)), number=1, repeat=3))
    st = e.state
    for _ in range(2):
        out = paged_step_jit(e.family, cfg, e.layout, shape, params, st, ints, floats, bitmask)
        st = out[1]
        jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(4):
        out = paged_step_jit(e.family, cfg, e.layout, shape, params, st, ints, floats, bitmask)
        st = out[1]
        jax.block_until_ready(out)
    per_call = (time.perf_counter() - t) / 4
    return {"batch": b, "per_call_ms": round(1e3 * per_call, 1), "per_loop_iteration_ms": round(1e3 * (t4 - t1) / 3, 1)}


def layout_cost(batch: int, shapes) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for d_out, d_in in shapes:
        w = jnp.asarray(rng.normal(size=(d_out, d_in)).astype(np.float32))
        wt = jnp.asarray(np.asarray(w).T.copy())
        x = jnp.asarray(rng.normal(size=(batch, d_in)).astype(np.float32))
        row = {"weight": [d_out, d_in]}
        for name, f, arg in (("out_in_einsum_ms", jax.jit(lambda x, w: jnp.einsum("tk,nk->tn", x, w)), w),
                             ("in_out_matmul_ms", jax.jit(lambda x, w: x @ w), wt)):
            f(x, arg).block_until_ready()
            row[name] = round(1e3 * min(timeit.repeat(lambda: f(x, arg).block_until_ready(), number=20, repeat=3)) / 20, 3)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mid")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dispatch_cost.json"))
    args = ap.parse_args()
    cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", CONFIGS[args.model]))
    params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(0))
    step = step_cost(cfg, params, args.batch)
    print(f"{args.model} paged decode step, batch {args.batch}: {step['per_call_ms']} ms per call (state donated), "
          f"{step['per_loop_iteration_ms']} ms per iteration inside one fori_loop program")
    layouts = layout_cost(args.batch, [(1536, 512), (6144, 512), (32000, 512)])
    for r in layouts:
        print(f"x[{args.batch}, {r['weight'][1]}] times a weight {r['weight']}: stored [out, in] {r['out_in_einsum_ms']} ms, "
              f"stored [in, out] {r['in_out_matmul_ms']} ms")
    write_record({"benchmark": "dispatch_cost", "model": args.model, "device": jax.devices()[0].device_kind,
                  "step": step, "layouts": layouts}, args.out)


if __name__ == "__main__":
    main()
