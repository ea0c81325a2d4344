"""Cost of batch-invariant mode: offline throughput with DEEPINFER_BATCH_INVARIANT=1 vs without,
same workload, run side by side (off, on, off, on) in one invocation.

    python benchmarks/batch_invariance_cost.py [--models bundled,tiny,mid] [--num-prompts 64]

Each measurement is benchmarks/offline_throughput.py in a fresh process (the
mode changes XLA flags, which are fixed when JAX starts) with the engine's
default settings (token budget 256, default buckets); prompts 32-256, outputs
16-64 by default. Prints output tok/s per run and the cost ratio
(best off / best on); writes benchmarks/results/batch_invariance_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402


def measure(model: str, invariant: bool, args) -> float:
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)
    env["DEEPINFER_BATCH_INVARIANT"] = "1" if invariant else "0"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "offline_throughput.py"), "--models", model,
               "--num-prompts", str(args.num_prompts), "--min-prompt", "32", "--max-prompt", str(args.max_prompt),
               "--min-out", "16", "--max-out", str(args.max_out), "--engine-defaults", "--out", out.name]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        return json.load(open(out.name))["results"][0]["output_tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,tiny,mid")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-out", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "batch_invariance_cost.json"))
    args = ap.parse_args()
    record = {"benchmark": "batch_invariance_cost", "num_prompts": args.num_prompts, "results": []}
    for model in args.models.split(","):
        runs = {"off": [], "on": []}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                runs[mode].append(measure(model, mode == "on", args))
                print(f"{model} mode {mode}: {runs[mode][-1]} output tok/s", flush=True)
        cost = max(runs["off"]) / max(runs["on"])
        record["results"].append({"model": model, "off_tok_s": runs["off"], "on_tok_s": runs["on"], "cost": round(cost, 3)})
        print(f"{model}: batch-invariant mode costs {cost:.2f}x (best off {max(runs['off'])} / best on {max(runs['on'])} tok/s)")
    write_record(record, args.out)


if __name__ == "__main__":
    main()
