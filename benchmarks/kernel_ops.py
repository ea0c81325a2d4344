"""Kernel vs reference time per op, on one V4 layer's shapes, side by side in one run.

    python benchmarks/kernel_ops.py                 # V4-Flash extents (a GPU: ~20 GB of weights and pools)
    python benchmarks/kernel_ops.py --scale small   # the same cases scaled down (a CPU: checks the script;
                                                    # interpret-mode times mean nothing and are not reported)

Cases: decode at batch 1 / 32 / 256 (each row its own request with --context tokens of history)
and one prefill chunk of 4096 tokens (a request's first chunk). Ops: the paged sparse attention
of a CSA layer (window ring + step keys + top-k selected compressed rows), the indexer's scores +
top-k, and the routed experts' grouped matmuls (SwiGLU fused). For each: median ms of the kernel
and of its pure-JAX reference, the bytes each op must read at least (weights, the rows it
attends, its queries) and its matmul FLOPs, as achieved bandwidth and FLOP/s against the
device's peak (--peak-gbs, --peak-tflops: an H200's 4800 GB/s and 989 dense bf16 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.models.interface import FlatBatch
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import index_select as ix
from pallas_kernels import sparse_attention as sa

FLASH = dict(heads=64, head_dim=512, window=128, backtrack=12, index_heads=64, index_head_dim=128, topk=512,
             hidden=4096, expert_width=2048, experts=256, per_token=6, ratio=4, page_size=64)
SMALL = dict(heads=4, head_dim=64, window=16, backtrack=4, index_heads=4, index_head_dim=32, topk=16,
             hidden=256, expert_width=256, experts=8, per_token=2, ratio=4, page_size=8)


def _median_ms(fn, args, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def _batch(rows, context, chunk, s):
    """rows requests, each with `context` tokens before the step and `chunk` tokens in it."""
    t = rows * chunk
    r = np.repeat(np.arange(rows), chunk)
    pos = np.tile(np.arange(chunk), rows) + context
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    fb = FlatBatch(positions=i32(pos), valid=jnp.ones(t, bool), row=i32(r), slot=i32(r), length=i32(np.full(t, context)),
                   start=i32(r * chunk), end=i32(np.full(t, context + chunk)), tables={})
    visible = (context + chunk) // s["ratio"]
    max_pages = max(-(-visible // s["page_size"]), 1)
    table = i32(np.arange(rows * max_pages).reshape(rows, max_pages)[r])
    return fb, table, max_pages, rows * max_pages


def attention_case(s, rows, context, chunk, dt, key):
    fb, table, max_pages, pages = _batch(rows, context, chunk, s)
    t, h, hd = fb.positions.shape[0], s["heads"], s["head_dim"]
    k = jax.random.split(key, 5)
    q = jax.random.normal(k[0], (t, h, hd), dt)
    kv = jax.random.normal(k[1], (t, hd), dt)
    ring = jax.random.normal(k[2], (rows, s["window"] + s["backtrack"], hd), dt)
    pool = jax.random.normal(k[3], (pages, s["page_size"], hd), dt)
    visible = (fb.positions + 1) // s["ratio"]
    scores = jax.random.normal(k[4], (t, max_pages * s["page_size"]))
    from deepinfer.models.deepseek_v4.indexer import select_top_k

    n = jnp.arange(max_pages * s["page_size"])[None, :] < visible[:, None]
    selected = select_top_k(scores, n, s["topk"])
    sink = jnp.zeros((h,), jnp.float32)
    args = (q, kv, ring, fb, pool, table, selected, sink)
    kw = dict(scale=hd**-0.5, window=s["window"])
    attended = min(s["topk"], int(visible.max())) + s["window"]
    cost = dict(bytes=t * attended * hd * dt.itemsize + 2 * q.size * dt.itemsize, flops=4 * t * h * attended * hd)
    return (sa.sparse_attention, sa.sparse_attention_ref), args, kw, cost


def indexer_case(s, rows, context, chunk, dt, key):
    fb, table, max_pages, pages = _batch(rows, context, chunk, s)
    t, ih, idim = fb.positions.shape[0], s["index_heads"], s["index_head_dim"]
    k = jax.random.split(key, 3)
    args = (jax.random.normal(k[0], (t, ih, idim), dt), jax.random.normal(k[1], (t, ih), jnp.float32),
            jax.random.normal(k[2], (pages, s["page_size"], idim), dt), table, (fb.positions + 1) // s["ratio"])
    scored = max_pages * s["page_size"]
    cost = dict(bytes=t * scored * idim * dt.itemsize, flops=2 * t * ih * scored * idim)
    return (ix.index_select, ix.index_select_ref), args, dict(k=s["topk"]), cost


def moe_case(s, rows, context, chunk, dt, key):
    t = rows * chunk
    n, e, d, w = t * s["per_token"], s["experts"], s["hidden"], s["expert_width"]
    k = jax.random.split(key, 5)
    experts = jax.random.randint(k[0], (n,), 0, e)
    sizes = jnp.bincount(experts, length=e).astype(jnp.int32)
    x = jax.random.normal(k[1], (n, d), dt)
    w1 = (jax.random.normal(k[2], (e, w, d), dt) * 0.02).astype(dt)
    w3 = (jax.random.normal(k[3], (e, w, d), dt) * 0.02).astype(dt)
    w2 = (jax.random.normal(k[4], (e, d, w), dt) * 0.02).astype(dt)

    def kernel(x, w1, w3, w2, sizes, interpret=False):
        hidden = gm.grouped_swiglu(x, w1, w3, sizes, limit=10.0, interpret=interpret)
        return gm.grouped_matmul(hidden, w2, sizes, interpret=interpret)

    def ref(x, w1, w3, w2, sizes):
        return gm.grouped_matmul_ref(gm.grouped_swiglu_ref(x, w1, w3, sizes, limit=10.0), w2, sizes)

    used = int((np.asarray(sizes) > 0).sum())
    cost = dict(bytes=used * 3 * w * d * dt.itemsize + 2 * n * d * dt.itemsize, flops=6 * n * w * d)
    return (kernel, ref), (x, w1, w3, w2, sizes), {}, cost


CASES = {"decode b1": (1, 1), "decode b32": (32, 1), "decode b256": (256, 1), "prefill 4k": (1, 4096)}
OPS = {"attention": attention_case, "indexer": indexer_case, "moe": moe_case}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", choices=("flash", "small"), default="flash")
    ap.add_argument("--context", type=int, default=4096, help="tokens of history per decode row")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-gbs", type=float, default=4800.0)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    s = FLASH if args.scale == "flash" else SMALL
    platform = jax.default_backend()
    interpret = platform == "cpu"
    dt = jnp.dtype(jnp.bfloat16)
    print(f"# platform {platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}, scale {args.scale}"
          + (" -- CPU: kernels in interpret mode, times not meaningful" if interpret else ""))
    print("| op | case | kernel ms | ref ms | ref / kernel | kernel GB/s (% peak) | kernel TFLOP/s (% peak) | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for op in args.ops.split(","):
        for case, (rows, chunk) in CASES.items():
            if args.scale == "small":
                rows, chunk = min(rows, 8), min(chunk, 64)
            context = 0 if chunk > 1 else (args.context if args.scale == "flash" else 128)
            (kernel, ref), op_args, kw, cost = OPS[op](s, rows, context, chunk, dt, jax.random.key(0))
            k_fn = jax.jit(lambda *a, f=kernel: f(*a, **kw, **({"interpret": True} if interpret else {})))
            r_fn = jax.jit(lambda *a, f=ref: f(*a, **kw))
            reps = 1 if interpret else args.reps
            k_ms, r_ms = _median_ms(k_fn, op_args, reps), _median_ms(r_fn, op_args, reps)
            k_out, r_out = jax.tree.leaves(k_fn(*op_args))[0], jax.tree.leaves(r_fn(*op_args))[0]
            diff = float(jnp.max(jnp.abs(k_out.astype(jnp.float32) - r_out.astype(jnp.float32))))
            gbs, tfs = cost["bytes"] / k_ms / 1e6, cost["flops"] / k_ms / 1e9
            if interpret:
                print(f"| {op} | {case} | - | - | - | - | - | {diff:.3g} |")
            else:
                print(f"| {op} | {case} | {k_ms:.3f} | {r_ms:.3f} | {r_ms / k_ms:.2f}x | {gbs:.0f} "
                      f"({100 * gbs / args.peak_gbs:.1f}%) | {tfs:.1f} ({100 * tfs / args.peak_tflops:.1f}%) "
                      f"| {diff:.3g} |")
            print(json.dumps({"op": op, "case": case, "kernel_ms": k_ms, "ref_ms": r_ms, "max_abs_diff": diff,
                              **cost}), flush=True)


if __name__ == "__main__":
    main()
