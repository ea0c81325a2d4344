"""Compiling a program ahead of time, from the shapes of its arguments, on any thread: the
compiled program lands in JAX's own cache, so the first dispatch with real arrays compiles
nothing. Used to compile step programs in the background while the engine serves
(warmup.BackgroundWarmup) and the prefix-cache programs beside the first step program."""

from __future__ import annotations

import threading

import jax


def abstract(tree):
    """Shapes, dtypes and shardings of a tree of arrays (what a program is compiled for). A single
    device's arrays go without a sharding: a dispatch with them lowers with the shardings left
    unspecified, and a program compiled for a stated one would be another cache entry (measured:
    every such program compiled again on first use). Abstract arguments pass through the same way."""
    def one(a):
        sharding = a.sharding if a.sharding is not None and len(a.sharding.device_set) > 1 else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


class CompileAhead:
    """``jitted.lower(*args).compile()`` for each argument list in turn, on one worker thread;
    ``join()`` waits for them. A failure is left to the caller's own dispatch, which compiles again
    and raises it where it is handled. Take ``abstract`` arguments on the caller's thread: live
    arrays may be donated meanwhile."""

    def __init__(self, jitted, arg_lists):
        jobs = [tuple(args) for args in arg_lists]
        self._thread = threading.Thread(target=self._run, args=(jitted, jobs), name="deepinfer-compile", daemon=True)
        self._thread.start()

    def _run(self, jitted, jobs) -> None:
        for args in jobs:
            try:
                jitted.lower(*args).compile()
            except Exception:  # the caller's dispatch compiles it again and raises there
                pass

    def join(self) -> None:
        self._thread.join()
