"""Rolling a slot back (speculative decoding's rejected drafts): the one host-side check.

The engine state holds no lengths: a slot's length is what the host says it is, so
rolling back k tokens is lowering that number. It is safe while the slot stays within
``max_backtrack`` of the furthest position it processed (``high_water``): the state's
rings keep exactly that many extra entries, and every ring entry or pool row past the
new length is rewritten before anything reads it.
"""

from __future__ import annotations

import numpy as np


def check_rollback(lengths, high_water, k, max_backtrack: int) -> None:
    """Raise ValueError unless rolling back k[b] tokens of each sequence (slot) is safe."""
    lengths, high_water, k = (np.asarray(a) for a in (lengths, high_water, k))
    if np.any(k < 0):
        raise ValueError(f"rollback counts must be >= 0, got {k.tolist()}")
    if np.any(k > lengths):
        raise ValueError(f"cannot roll back {k.tolist()} tokens from sequences of lengths {lengths.tolist()}")
    too_far = (high_water - (lengths - k)) > max_backtrack
    if np.any(too_far):
        b = int(np.argmax(too_far))
        raise ValueError(
            f"sequence {b}: rolling back to length {int(lengths[b] - k[b])} would go "
            f"{int(high_water[b] - lengths[b] + k[b])} tokens behind the furthest processed position "
            f"({int(high_water[b])}); at most max_backtrack={max_backtrack} rows are kept"
        )
