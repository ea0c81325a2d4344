"""Count XLA compilations (JAX's monitoring events), to prove a warm engine compiles nothing.

JAX reports a backend compile also for a program its persistent compilation cache supplies (the
event times ``compile_or_get_cached``), so those count too: the program was not ready in memory."""

from __future__ import annotations

import threading

import jax.monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Context manager: ``with CompileCounter() as c: ...; c.count`` is the number of backend compiles
    made by the thread that entered it (a background warm-up compiling on its own thread meanwhile is
    not the code being watched); ``all_threads=True`` counts every thread's."""

    def __init__(self, all_threads: bool = False):
        self.count = 0
        self._thread = None if all_threads else threading.get_ident()

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE and (self._thread is None or threading.get_ident() == self._thread):
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
