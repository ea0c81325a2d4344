"""XLA settings the suite runs with, and the environment of the subprocesses it starts.

The suite compiles with LLVM at -O0 (``--xla_backend_optimization_level=0``): the tiny models' steps
take milliseconds while their programs take seconds to compile, and -O0 cut test_incremental.py from
217 s to 160 s (2026-12-07). What a test checks does not depend on it: comparisons within a run use
programs compiled alike, and those against transformers use tolerances. The batch-invariance needle
(tests/test_batch_invariance.py) drops it and runs at XLA's default level, since vectorised code is
where a batch-dependent reduction order would show. An optimisation level already in XLA_FLAGS is
kept: ``XLA_FLAGS=--xla_backend_optimization_level=3 pytest`` runs everything as a deployment does."""

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
