"""Shared helpers for the benchmark scripts: timing, writing the JSON record."""

import json
import os
import time


def best_time(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` wall-clock runs of fn() (least disturbed by a noisy machine)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def write_record(record: dict, path: str) -> None:
    """Write the benchmark's JSON record to path and print it as one line."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))
