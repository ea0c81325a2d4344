"""Count XLA compilations (JAX's monitoring events), to prove a warm engine compiles nothing."""

from __future__ import annotations

import jax.monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Context manager: ``with CompileCounter() as c: ...; c.count`` is the number of backend compiles."""

    def __init__(self):
        self.count = 0

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
