"""Shared timing helper for the benchmark scripts."""

import time


def best_time(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` wall-clock runs of fn() (least disturbed by a noisy machine)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
