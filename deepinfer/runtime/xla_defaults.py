"""XLA options deepinfer turns on by default, set in XLA_FLAGS by ``import deepinfer`` (they are read
when JAX starts its backend, so later is too late).

``--xla_cpu_copy_insertion_use_region_analysis=true``: without it XLA CPU copies every per-slot
state leaf twice per step (window and compressor rings, penalty counts: each is read for the step's
own tokens and updated in place in the same program, and the default copy insertion does not see
that the read can go first). With 16 slots that was ~0.2 ms of a 1.6 ms batch-1 step on the bundled
model (BENCHMARKS.md §1). The option only changes which buffers are copied, not any arithmetic.
Known to jax 0.10.2 and 0.11.x; XLA refuses unknown flags at start-up, so a jax that drops it
fails loudly here rather than silently running slower.
"""

from __future__ import annotations

import os

DEFAULT_FLAGS = ("--xla_cpu_copy_insertion_use_region_analysis=true",)


def add_default_flags() -> None:
    """Append each default flag to XLA_FLAGS unless XLA_FLAGS already sets that option (the user's
    value wins). Effective only before JAX's backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in DEFAULT_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = (flags + " " + flag).strip()
    os.environ["XLA_FLAGS"] = flags
