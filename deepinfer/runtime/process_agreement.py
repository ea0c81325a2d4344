"""What the processes of one multi-process engine (jax.distributed) must agree on though each would
choose it alone. Every process runs the same schedule only if every input to it is the same; two are
not given by the caller:

- the seed of a sampled request that has none (one fresh random seed per request): here derived from
  the request id and a base drawn once by process 0 and broadcast when the engine is built;
- confidence-scheduled speculation's step costs (timings): process 0's warm-up figures, broadcast,
  and not refined by each process's own step times afterwards (the lockstep server refines them with
  process 0's times, which it ships: runtime/lockstep.py).

With one process nothing changes: a fresh seed per request, the model refined in the loop.
"""

from __future__ import annotations

import hashlib
import secrets

import jax
import numpy as np


def _from_process_0(values: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


class SeedSource:
    """``source(sampling_params, request_id)`` -> the seed the request samples with."""

    def __init__(self):
        self._base = None
        if jax.process_count() > 1:  # a collective: every process builds its engine at the same point
            self._base = int(_from_process_0(np.array([secrets.randbits(31)], np.int32))[0])

    def __call__(self, sp, request_id: str) -> int:
        if sp.seed is not None:
            return sp.seed
        if self._base is None:
            return sp.resolved_seed()
        digest = hashlib.blake2b(f"{self._base}:{request_id}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")


def agreed_costs(costs: dict) -> tuple[dict, bool]:
    """(the warm-up step costs every process plans with, whether the model must stay frozen)."""
    if jax.process_count() == 1 or not costs:
        return costs, False
    keys = sorted(costs)
    values = _from_process_0(np.array([costs[k] for k in keys], np.float64))
    return dict(zip(keys, values.tolist())), True
