"""Cold start: seconds from launching `python -m deepinfer.serve` to the first streamed token,
and the number of compiled step programs, without and with JAX's persistent compilation cache.

    python benchmarks/cold_start.py [--server-args "..."]

Three launches on the default model (built beforehand, not timed): compile cache
off; cache on but empty (compiles and fills it); cache on and warm (the same
folder again). Each: time to /health, time to the first token of one streamed
request sent as soon as the server is up, what the startup log says was
compiled before it was ready, and how long the rest took in the background
(waited for before the next launch). Writes benchmarks/results/cold_start.json.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.timing import write_record  # noqa: E402
from deepinfer.default_model import NAME  # noqa: E402
from deepinfer.serve.launch import launch, stop  # noqa: E402


def first_token_s(base: str) -> float:
    t = time.perf_counter()
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t
    raise RuntimeError("no token")


def run(label: str, args: list[str], log_path: str) -> dict:
    t0 = time.perf_counter()
    proc, port, up = launch(args, log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        ttft = first_token_s(base)
        total = time.perf_counter() - t0
        # the server keeps compiling its other programs in the background: let that finish (or time
        # out) so the next launch does not share the cores with it and its time is in the record
        deadline = time.perf_counter() + 300
        while time.perf_counter() < deadline and "all step programs ready" not in open(log_path).read():
            if "compiling in the background failed" in open(log_path).read():
                break
            time.sleep(0.5)
    finally:
        stop(proc)
    log = open(log_path).read()
    m = re.search(r"compiled (\d+) step programs in ([\d.]+) s", log)
    background = re.search(r"all step programs ready \(([\d.]+) s in the background\)", log)
    return {"scenario": label, "seconds_to_health": round(up, 2), "seconds_to_first_token": round(total, 2),
            "first_request_ttft_s": round(ttft, 3), "programs_before_ready": int(m.group(1)) if m else None,
            "warmup_compile_s": float(m.group(2)) if m else None,
            "background_compile_s": float(background.group(1)) if background else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-args", default="", help="extra flags for the server (default: its defaults)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cold_start.json"))
    args = ap.parse_args()
    extra = args.server_args.split()
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for label, flags in (("cache off", ["--compile-cache", "off"]),
                             ("cache cold (empty)", ["--compile-cache", cache]),
                             ("cache warm", ["--compile-cache", cache])):
            r = run(label, extra + flags, os.path.join(os.path.dirname(args.out), "cold_start_server.log"))
            results.append(r)
            print(f"{label:>20}: first token after {r['seconds_to_first_token']} s (health after "
                  f"{r['seconds_to_health']} s; {r['programs_before_ready']} programs compiled before ready in "
                  f"{r['warmup_compile_s']} s; the rest in {r['background_compile_s']} s in the background)", flush=True)
    record = {"benchmark": "cold_start", "server_args": args.server_args, "results": results}
    write_record(record, args.out)


if __name__ == "__main__":
    main()
