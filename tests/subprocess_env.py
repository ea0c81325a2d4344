"""XLA settings the suite runs with, and the environment of the subprocesses it starts.

The suite compiles with LLVM at -O0 (``--xla_backend_optimization_level=0``): the tiny models' steps
take milliseconds while their programs take seconds to compile. -O0 cut an (8, 8) step program of the
bundled model from 10.5 s to 6.8 s and test_incremental.py from 217 s to 160 s (2026-12-07); the steps
themselves run slower. Tests compare programs compiled alike within a run, or against transformers
within tolerances; -O0's numerics differ from the default level's in the last bits (the bundled
model's logits by up to 1.5e-5, the same greedy tokens), so the batch-invariance needle
(tests/test_batch_invariance.py), which is about those bits, drops it and runs at XLA's default level.
An optimisation level already in XLA_FLAGS is kept: ``XLA_FLAGS=--xla_backend_optimization_level=3
pytest`` compiles everything as a deployment does."""

import os

OPT_OPTION = "--xla_backend_optimization_level"
SUITE_OPT_FLAG = OPT_OPTION + "=0"


def use_suite_opt_level() -> None:
    """Add the suite's optimisation level to XLA_FLAGS unless one is set; before JAX's backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if OPT_OPTION not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + SUITE_OPT_FLAG).strip()


def xla_flags(device_count: int | None = None) -> str:
    """XLA_FLAGS for a subprocess: this run's optimisation level, and ``device_count`` fake CPU devices."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(OPT_OPTION)]
    return " ".join(kept + ([f"--xla_force_host_platform_device_count={device_count}"] if device_count else []))


def cpu_devices_env(device_count: int, **extra: str) -> dict:
    """os.environ for a subprocess on ``device_count`` fake CPU devices."""
    return {**os.environ, "XLA_FLAGS": xla_flags(device_count), "JAX_PLATFORMS": "cpu", **extra}
