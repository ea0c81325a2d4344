"""Ragged flat batches for the kernel tests: decode and prefill rows mixed, padding at the end.

Each row is (slot, committed length, tokens in the step); pages of a request's compressed rows
are laid out at random in a shared pool, so block tables are not the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.models.interface import FlatBatch

# the kernel tests run the real GPU lowering where there is one (scripts/gpu_check.sh), interpret mode on a CPU
INTERPRET = jax.default_backend() == "cpu"

# (slot, length before the step, tokens in the step): a 1-token decode whose window wrapped the ring,
# a prefill from 0 (no ring content, 0 compressed rows visible at first), a chunk in the middle of a
# prompt, a decode at length 1
ROWS = ((2, 37, 1), (0, 0, 5), (3, 12, 4), (1, 1, 1))


def ragged_batch(rows=ROWS, pad: int = 3, max_pages: int = 6, num_pages: int = 40, history_start=None, seed=0):
    """-> (FlatBatch, table [T, max_pages]) with ``pad`` padding tokens after the rows."""
    rng = np.random.default_rng(seed)
    pos, valid, row, slot, length, start, end, table = [], [], [], [], [], [], [], []
    pages = rng.permutation(num_pages)[: len(rows) * max_pages].reshape(len(rows), max_pages)
    at = 0
    for r, (s, n0, n) in enumerate(rows):
        for i in range(n):
            pos.append(n0 + i), valid.append(True), row.append(r), slot.append(s)
            length.append(n0), start.append(at), end.append(n0 + n), table.append(pages[r])
        at += n
    for _ in range(pad):  # padding: a row index past the rows, an out-of-range slot, as the engine packs it
        pos.append(0), valid.append(False), row.append(len(rows)), slot.append(99)
        length.append(0), start.append(at), end.append(0), table.append(np.zeros(max_pages, int))
    i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    hs = None if history_start is None else i32([history_start] * len(pos))
    fb = FlatBatch(positions=i32(pos), valid=jnp.asarray(valid), row=i32(row), slot=i32(slot), length=i32(length),
                   start=i32(start), end=i32(end), tables={}, history_start=hs)
    return fb, i32(np.stack(table))
