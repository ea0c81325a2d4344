"""Compiling a program ahead of time, from the shapes of its arguments, on any thread: the
compiled program lands in JAX's own cache, so the first dispatch with real arrays compiles
nothing. Used to compile step programs in the background while the engine serves
(warmup.BackgroundWarmup) and the prefix-cache program beside the first step program."""

from __future__ import annotations

import threading

import jax


def abstract(tree):
    """Shapes, dtypes and shardings of a tree of arrays (what a program is compiled for). A single
    device's arrays go without a sharding: a dispatch with them lowers with the shardings left
    unspecified, and a program compiled for a stated one would be another cache entry (measured:
    every such program compiled again on first use)."""
    def one(a):
        sharding = a.sharding if len(a.sharding.device_set) > 1 else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


class CompileAhead:
    """``jitted.lower(*args).compile()`` on a worker thread; ``join()`` waits for it. A failure is
    left to the caller's own dispatch, which compiles again and raises it where it is handled.
    Take ``abstract`` arguments on the caller's thread: live arrays may be donated meanwhile."""

    def __init__(self, jitted, *args, _many=None):
        jobs = _many if _many is not None else [args]
        self._thread = threading.Thread(target=self._run, args=(jitted, jobs), name="deepinfer-compile", daemon=True)
        self._thread.start()

    @classmethod
    def each(cls, jitted, arg_lists) -> "CompileAhead":
        """Compile ``jitted`` for each argument list in turn, on one worker thread."""
        return cls(jitted, _many=list(arg_lists))

    def _run(self, jitted, jobs) -> None:
        for args in jobs:
            try:
                jitted.lower(*args).compile()
            except Exception:  # the caller's dispatch compiles it again and raises there
                pass

    def join(self) -> None:
        self._thread.join()
