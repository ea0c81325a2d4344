"""Step shapes come in buckets (few compiled programs): the bucket a count falls in, and the one
(token bucket, row bucket) shape a step runs as. Host only.

Each token bucket t is compiled with one row bucket: the smallest holding min(t, most rows). A
step of n tokens over m rows (m <= n: every row has a token) runs in the smallest token bucket
holding n, whose row bucket then holds m. So a decode step of m rows runs as (m, m) rounded up
(it pays for its own rows, not for a prefill-sized bucket), a prefill chunk as (t, most rows),
and there is one program per token bucket instead of one per (token, row) pair."""

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


def rows_for(token_bucket: int, row_buckets: tuple[int, ...]) -> int:
    """The row bucket compiled with a token bucket."""
    return pick_bucket(min(token_bucket, row_buckets[-1]), row_buckets)


def step_shape(num_tokens: int, num_rows: int, token_buckets: tuple[int, ...],
               row_buckets: tuple[int, ...]) -> tuple[int, int]:
    """(token bucket, row bucket) of a step (ValueError past the largest token bucket)."""
    t = pick_bucket(max(num_tokens, num_rows, 1), token_buckets)
    return t, rows_for(t, row_buckets)
