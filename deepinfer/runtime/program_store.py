"""Compiled step programs kept on disk, so a restarted engine loads them instead of tracing and
lowering them again.

JAX's persistent compilation cache is keyed by the lowered program: a hit still pays for tracing
the model and lowering it to StableHLO (bundled model, the server's first program: 0.7 s tracing,
0.4 s lowering, 0.4 s fetching, on the 2-core machine). This store keys a serialized executable by
what decides the program before any tracing: this package's source (every .py file of deepinfer/,
sharding/ and pallas_kernels/), the jax / jaxlib / numpy versions, the backend and its devices,
XLA_FLAGS, the DEEPINFER_* environment, the jax options that change tracing, the program's static
arguments (model config, layout, plan shape: their reprs, which hold every field) and the shapes,
dtypes and shardings of its array arguments. Loading one (``deserialize_and_load``) is the 0.4 s
fetch alone.

``StoredProgram`` wraps one jitted step program (called as ``f(family, cfg, layout, shape, *arrays)``):
``compile`` loads or compiles the program for abstract arguments (and saves it), and from then on
calls with that shape run the compiled executable directly; shapes never compiled through it go to
the jitted function as before. Every engine's programs are wrapped; only with
``EngineConfig.program_cache_dir`` (the server sets it under its compile cache) are the executables
also saved and loaded, otherwise they live in memory. Loading an executable runs code from that
folder: keep it as private as the compile cache. A file that fails to load is ignored (and rewritten).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile

import jax

from deepinfer.runtime.ahead_of_time import abstract

log = logging.getLogger("deepinfer.runtime.engine")

FORMAT = 1  # bump when what a file holds changes
_SOURCE_DIRS = ("deepinfer", "sharding", "pallas_kernels")
# jax options that change what a traced program is
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
                "jax_default_prng_impl", "jax_numpy_rank_promotion", "jax_use_shardy_partitioner")


def source_digest(root: str) -> str:
    """sha256 of every .py file under the source folders (path and bytes, in sorted order)."""
    h = hashlib.sha256()
    for top in _SOURCE_DIRS:
        for folder, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def environment_text() -> str:
    """Everything outside a program's own arguments that decides what it compiles to."""
    import jaxlib
    import numpy

    devices = jax.devices()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [f"format {FORMAT}", f"jax {jax.__version__} jaxlib {jaxlib.__version__} numpy {numpy.__version__}",
             f"backend {jax.default_backend()} {[(d.id, d.device_kind, d.process_index) for d in devices]}",
             f"processes {jax.process_count()} this {jax.process_index()}",
             f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}",
             f"env {sorted((k, v) for k, v in os.environ.items() if k.startswith('DEEPINFER_'))}",
             f"options {[(o, str(getattr(jax.config, o, None))) for o in _JAX_OPTIONS]}",
             f"source {source_digest(root)}"]
    return "\n".join(lines)


class ProgramStore:
    """Serialized executables in one folder, a file per key (see the module's docstring)."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self._environment = environment_text()  # the source digest is read once per engine
        self.loaded = self.saved = 0

    def key(self, name: str, statics: tuple, arrays: tuple) -> str | None:
        """The file name for program ``name`` with these static and (abstract) array arguments;
        None when a repr holds an object address (it would differ in every process: never stored)."""
        text = "\n".join([self._environment, name, *map(repr, statics),
                          repr(jax.tree.structure(arrays)), repr(jax.tree.leaves(arrays))])
        if " at 0x" in text:
            return None
        return hashlib.sha256(text.encode()).hexdigest() + ".exe"

    def load(self, key: str):
        """The executable saved under ``key``, loaded onto the devices; None if absent or unreadable."""
        path = os.path.join(self.folder, key)
        if not os.path.exists(path):
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            compiled = deserialize_and_load(blob, in_tree, out_tree)
        except Exception as e:  # a truncated or foreign file: compile again (and overwrite it)
            log.warning("program cache: %s could not be loaded (%s: %s); compiling it again", path, type(e).__name__, e)
            return None
        self.loaded += 1
        return compiled

    def save(self, key: str, compiled) -> None:
        """Write ``compiled`` under ``key`` (atomically: a reader sees the whole file or none)."""
        from jax.experimental.serialize_executable import serialize

        try:
            data = pickle.dumps(serialize(compiled))
        except Exception as e:  # e.g. a program with closed-over constants: left to JAX's own cache
            log.info("program cache: not storable (%s: %s)", type(e).__name__, e)
            return
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.folder, key))
        self.saved += 1


class StoredProgram:
    """One jitted step program, and the executables ``compile`` made or loaded for it by plan shape
    (a call with such a shape runs the executable directly: no tracing)."""

    def __init__(self, name: str, jitted, store: ProgramStore | None):
        self.name, self.jitted, self.store = name, jitted, store
        self._compiled: dict = {}  # shape -> ((family, cfg, layout), executable)

    def __call__(self, family, cfg, layout, shape, *arrays):
        entry = self._compiled.get(shape)
        if entry is not None:
            (f, c, l), compiled = entry
            if f is family and c is cfg and l is layout:
                return compiled(*arrays)
        return self.jitted(family, cfg, layout, shape, *arrays)

    def lower(self, family, cfg, layout, shape, *arrays):
        return self.jitted.lower(family, cfg, layout, shape, *arrays)

    def compile(self, family, cfg, layout, shape, *arrays):
        """The executable for these (abstract) arguments: loaded from the store, or compiled (and
        saved there); later calls with ``shape`` run it."""
        arrays = abstract(arrays)
        statics = (family, cfg, layout, shape, getattr(self.jitted, "specs", None))
        key = self.store.key(self.name, statics, arrays) if self.store is not None else None
        compiled = self.store.load(key) if key is not None else None
        if compiled is None:
            compiled = self.jitted.lower(family, cfg, layout, shape, *arrays).compile()
            if key is not None:
                self.store.save(key, compiled)
        self._compiled[shape] = ((family, cfg, layout), compiled)
        return compiled


def stored_programs(programs, folder: str | None):
    """An engine's step programs (paged_step.StepPrograms) wrapped as StoredPrograms; ``folder``:
    the store's (None: executables compiled ahead of time are kept in memory only)."""
    if folder and jax.process_count() > 1:  # one engine over several processes: not tried, so not stored
        log.info("program cache: off with %d processes", jax.process_count())
        folder = None
    store = ProgramStore(folder) if folder else None
    return type(programs)(*(None if p is None else StoredProgram(name, p, store)
                            for name, p in zip(programs._fields, programs)))
