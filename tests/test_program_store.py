"""The on-disk store of compiled step programs (runtime/program_store.py): a restart loads them
instead of tracing and lowering; keys change with what decides a program; a bad file is compiled
again, not fatal."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from deepinfer.runtime.program_store import ProgramStore, StoredProgram, source_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _toy(family, cfg, layout, shape, x, y):
    return x * shape + y, jnp.sum(x)


TOY = jax.jit(_toy, static_argnums=(0, 1, 2, 3), donate_argnums=(4,))
ARGS = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))


class Traces:
    """Counts traces of the toy function (JAX's monitoring events)."""

    def __enter__(self):
        self.count = 0
        self._listener = lambda event, secs, **kw: self._seen(event, kw)
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def _seen(self, event, kw):
        self.count += event.endswith("jaxpr_trace_duration") and kw.get("fun_name") == "_toy"

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def test_a_saved_program_is_loaded_by_a_new_store_without_tracing(tmp_path):
    first = StoredProgram("toy", TOY, ProgramStore(str(tmp_path)))
    first.compile("fam", "cfg", "layout", 3, *ARGS)
    assert first.store.saved == 1 and len(os.listdir(tmp_path)) == 1
    again = StoredProgram("toy", TOY, ProgramStore(str(tmp_path)))
    with Traces() as traces:
        again.compile("fam", "cfg", "layout", 3, *ARGS)
        x = jnp.arange(4, dtype=jnp.float32)
        out, total = again("fam", "cfg", "layout", 3, x, jnp.ones(4))
    assert traces.count == 0 and again.store.loaded == 1 and again.store.saved == 0
    np.testing.assert_array_equal(out, [1, 4, 7, 10])
    assert float(total) == 6 and x.is_deleted()  # the donation is part of the stored program
    # a shape never compiled through it goes to the jitted function
    out, _ = again("fam", "cfg", "layout", 5, jnp.ones(4), jnp.ones(4))
    np.testing.assert_array_equal(out, [6] * 4)


def test_keys_change_with_statics_and_argument_types(tmp_path):
    store = ProgramStore(str(tmp_path))
    base = store.key("toy", ("fam", "cfg", "layout", 3), ARGS)
    assert base == store.key("toy", ("fam", "cfg", "layout", 3), ARGS)
    assert base != store.key("toy", ("fam", "cfg", "layout", 4), ARGS)
    assert base != store.key("other", ("fam", "cfg", "layout", 3), ARGS)
    assert base != store.key("toy", ("fam", "cfg2", "layout", 3), ARGS)
    assert base != store.key("toy", ("fam", "cfg", "layout", 3), (ARGS[0], jax.ShapeDtypeStruct((4,), jnp.bfloat16)))
    assert base != store.key("toy", ("fam", "cfg", "layout", 3), (ARGS[0], jax.ShapeDtypeStruct((5,), jnp.float32)))
    # an object whose repr is its address differs in every process: never stored
    assert store.key("toy", (object(), "cfg", "layout", 3), ARGS) is None
    program = StoredProgram("toy", TOY, store)
    program.compile(object(), "cfg", "layout", 3, *ARGS)
    assert store.saved == 0 and os.listdir(tmp_path) == []


def test_source_digest_follows_every_source_file(tmp_path):
    pkg = tmp_path / "deepinfer" / "models"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    before = source_digest(str(tmp_path))
    (pkg / "a.py").write_text("x = 2\n")
    changed = source_digest(str(tmp_path))
    (tmp_path / "pallas_kernels").mkdir()
    (tmp_path / "pallas_kernels" / "k.py").write_text("")
    added = source_digest(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not source")
    assert len({before, changed, added}) == 3 and source_digest(str(tmp_path)) == added


def test_an_unreadable_file_is_compiled_again_and_rewritten(tmp_path, caplog):
    StoredProgram("toy", TOY, ProgramStore(str(tmp_path))).compile("fam", "cfg", "layout", 3, *ARGS)
    (path,) = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:100])  # truncated
    again = StoredProgram("toy", TOY, ProgramStore(str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="deepinfer.runtime.engine"):
        again.compile("fam", "cfg", "layout", 3, *ARGS)
    assert "could not be loaded" in caplog.text and str(path) in caplog.text
    assert again.store.loaded == 0 and again.store.saved == 1
    out, _ = again("fam", "cfg", "layout", 3, jnp.ones(4), jnp.zeros(4))
    np.testing.assert_array_equal(out, [3] * 4)
    third = StoredProgram("toy", TOY, ProgramStore(str(tmp_path)))
    third.compile("fam", "cfg", "layout", 3, *ARGS)
    assert third.store.loaded == 1


def test_a_restarted_engine_loads_its_step_programs_and_gives_the_same_tokens(tmp_path):
    """Two fresh processes on the bundled model, one store: the first traces and saves every step
    program (the constrained-step halves included), the second traces none, loads them all, and its
    tokens (greedy, thinking-budget rows running the halves) are the first's."""
    def start():
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "program_store_run.py"), str(tmp_path)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = start(), start()
    assert cold["loaded"] == 0 and cold["saved"] == cold["step_traces"] >= 4  # 2 step shapes + their halves
    assert warm["loaded"] == cold["saved"] and warm["saved"] == 0 and warm["step_traces"] == 0
    assert warm["tokens"] == cold["tokens"]
    assert any(7 in t for t in cold["tokens"])  # the thinking budget's end marker was forced
