"""Step shapes come in buckets (few compiled programs): the bucket a count falls in. Host only."""

from __future__ import annotations


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding n (ValueError past the largest: a plan must fit its shape)."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """pick_bucket, but the largest bucket past them all (a cost model may be asked beyond)."""
    return pick_bucket(min(max(n, 1), buckets[-1]), buckets)
