"""CompileCounter (runtime/compile_guard.py) counts what was not ready in memory: a compile, and a
program read from JAX's persistent compilation cache (the suite shares one, tests/conftest.py, so
"nothing compiles after warm-up" must not go blind to a program the cache supplies)."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from deepinfer.runtime.compile_guard import CompileCounter


def _fresh_function():
    """A new function object each call: nothing JAX keeps in memory matches it, the persistent cache's
    key (the lowered program) does."""
    def scaled_sine(x):
        return jnp.sin(x) * 7.25 + 3.0
    return scaled_sine


def test_a_program_read_from_the_persistent_cache_counts_as_a_compile():
    assert jax.config.jax_compilation_cache_dir  # set for the whole run by tests/conftest.py
    hits = []
    listener = lambda event, secs, **kw: hits.append(event) if event.endswith("compile_time_saved_sec") else None  # noqa: E731
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # a toy program compiles in ms
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        x = np.arange(5.0, dtype=np.float32)
        with CompileCounter() as first:
            jax.jit(_fresh_function())(x)
        hits_before = len(hits)  # (0, or 1 when JAX_COMPILATION_CACHE_DIR names a cache an earlier run filled)
        with CompileCounter() as second:
            out = jax.jit(_fresh_function())(x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    assert len(hits) == hits_before + 1  # the second program came from the cache, not the compiler
    assert first.count == 1 and second.count == 1
    np.testing.assert_allclose(out, np.sin(x) * 7.25 + 3.0, rtol=1e-6)
