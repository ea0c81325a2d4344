"""Serving benchmark against the HTTP server, in the shape of `vllm bench serve`.

    python benchmarks/serving.py [--base-url http://127.0.0.1:8000] [--concurrencies 1,4,16,64]
                                 [--rates 4,16,64] [--num-requests 64] [--max-seconds 60]

Without --base-url it starts `python -m deepinfer.serve` on the default model
(extra server flags via --server-args). Each scenario sends --num-requests
streaming completions (prompts of 32-256 tokens of random words, max_tokens
16-128, greedy, ignore_eos; seed 0): at a fixed concurrency (at most c in
flight), or with Poisson arrivals at a rate (requests/s, unbounded
concurrency). A scenario stops launching after --max-seconds. Reports TTFT,
TPOT ((e2e - TTFT) / (tokens - 1)), ITL (gaps between streamed chunks) at p50
and p99, output tokens/s and requests/s; writes benchmarks/results/serving.json
and two PNG plots next to it (throughput and latency vs concurrency / rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.default_model import NAME  # noqa: E402
from deepinfer.serve.launch import launch, stop  # noqa: E402

WORDS = "the of and to in is that for it as with was on be by at this from or an are not have which one".split()


def workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(32, 256)
        text = ""
        while len(text) < target:
            text += rng.choice(WORDS) + " "
        out.append((text[:target], rng.randint(16, 128)))
    return out


async def one(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, tokens = [], 0
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices"):
                chunks.append(time.perf_counter())
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    end = time.perf_counter()
    if not chunks:
        return {"error": "no tokens"}
    ttft = chunks[0] - t0
    return {"ttft": ttft, "e2e": end - t0, "tokens": tokens, "itl": list(np.diff(chunks)),
            "tpot": (end - t0 - ttft) / max(tokens - 1, 1)}


async def scenario(base: str, model: str, reqs, concurrency: int | None, rate: float | None, max_seconds: float) -> dict:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency or len(reqs))
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()

        async def guarded(p, m):
            async with sem:
                return await one(client, base, model, p, m)

        tasks = []
        for p, m in reqs:
            if time.perf_counter() - t0 > max_seconds:
                break
            tasks.append(asyncio.create_task(guarded(p, m)))
            if rate is not None:
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]

    def pct(values, q):
        return round(1e3 * float(np.percentile(values, q)), 2) if values else None

    itl = [x for r in ok for x in r["itl"]]
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency, "rate": rate, "requests": len(results), "failed": len(results) - len(ok),
        "duration_s": round(duration, 2), "requests_per_s": round(len(ok) / duration, 2),
        "output_tokens_per_s": round(out_tokens / duration, 1), "output_tokens": out_tokens,
        **{f"{name}_ms_p{q}": pct(vals, q) for name, vals in (("ttft", [r["ttft"] for r in ok]),
                                                          ("tpot", [r["tpot"] for r in ok]), ("itl", itl))
           for q in (50, 99)},
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
    }


def plot(record: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    conc = [r for r in record["results"] if r["concurrency"] is not None]
    rates = [r for r in record["results"] if r["rate"] is not None]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for rows, key, label in ((conc, "concurrency", "concurrency"), (rates, "rate", "Poisson rate (req/s)")):
        axis = ax[0] if key == "concurrency" else ax[1]
        xs = [r[key] for r in rows]
        axis.plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", label="output tok/s")
        axis2 = axis.twinx()
        axis2.plot(xs, [r["requests_per_s"] for r in rows], "s--", color="tab:orange", label="req/s")
        axis.set_xscale("log", base=2)
        axis.set_xlabel(label)
        axis.set_ylabel("output tokens/s")
        axis2.set_ylabel("requests/s")
        axis.set_title(f"throughput vs {key}")
    fig.suptitle(f"deepinfer serving, {record['model']} on {record['device']}")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "serving_throughput.png"))
    fig.savefig(paths[-1], dpi=100)
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for axis, metric in zip(ax, ("ttft", "tpot", "itl")):
        for q, style in ((50, "o-"), (99, "s--")):
            axis.plot([r["concurrency"] for r in conc], [r[f"{metric}_ms_p{q}"] for r in conc], style, label=f"p{q}")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("concurrency")
        axis.set_ylabel("ms")
        axis.set_title(metric.upper())
        axis.legend()
    fig.suptitle("latency percentiles vs concurrency")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "serving_latency.png"))
    fig.savefig(paths[-1], dpi=100)
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--model", default=NAME, help="served model name (the server default)")
    ap.add_argument("--server-args", default="--max-num-seqs 64 --max-num-batched-tokens 512 --max-model-len 512")
    ap.add_argument("--concurrencies", default="1,4,16,64")
    ap.add_argument("--rates", default="4,16,64")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=60)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "serving.json"))
    args = ap.parse_args()
    proc = None
    base = args.base_url
    if base is None:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        proc, port, up = launch(args.server_args.split(), os.path.join(os.path.dirname(args.out), "serving_server.log"))
        base = f"http://127.0.0.1:{port}"
        print(f"server up in {up:.1f} s at {base}", flush=True)
    try:
        device = "unknown"
        reqs = workload(args.num_requests)
        asyncio.run(scenario(base, args.model, reqs[:4], 4, None, 30))  # warm the path
        record = {"benchmark": "serving", "model": args.model, "device": device, "num_requests": args.num_requests,
                  "server_args": args.server_args if args.base_url is None else None, "results": []}
        try:
            import jax

            record["device"] = jax.devices()[0].device_kind
        except Exception:
            pass
        print(f"{'scenario':>12} {'req/s':>7} {'out tok/s':>9} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} "
              f"{'ITL p50/p99 ms':>16} {'failed':>6}")
        scenarios = [(int(c), None) for c in args.concurrencies.split(",") if c] + \
                    [(None, float(r)) for r in args.rates.split(",") if r]
        for c, rate in scenarios:
            r = asyncio.run(scenario(base, args.model, reqs, c, rate, args.max_seconds))
            record["results"].append(r)
            name = f"conc {c}" if c is not None else f"rate {rate:g}/s"
            print(f"{name:>12} {r['requests_per_s']:>7} {r['output_tokens_per_s']:>9} "
                  f"{r['ttft_ms_p50']:>8}/{r['ttft_ms_p99']:<8} {r['tpot_ms_p50']:>8}/{r['tpot_ms_p99']:<8} "
                  f"{r['itl_ms_p50']:>7}/{r['itl_ms_p99']:<8} {r['failed']:>6}", flush=True)
    finally:
        if proc is not None:
            stop(proc)
    write_record(record, args.out)
    try:
        paths = plot(record, os.path.dirname(args.out))
    except ImportError as e:  # the plots need the bench extra's matplotlib; the record is written
        print(f"no plots ({e}): pip install -e '.[bench]'")
        paths = []
    for p in paths:
        print("plot:", p)


if __name__ == "__main__":
    main()
