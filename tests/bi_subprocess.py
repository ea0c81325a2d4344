"""Run a test's check in a fresh process with DEEPINFER_BATCH_INVARIANT=1: the XLA flag that mode
needs must be set before JAX starts, which a process that already imported JAX cannot do."""

from __future__ import annotations

import os
import subprocess
import sys


def run_batch_invariant(module: str, function: str, timeout: float = 900) -> None:
    """Call ``module.function()`` in batch-invariant mode; it must print "BITWISE OK"."""
    env = {**os.environ, "DEEPINFER_BATCH_INVARIANT": "1"}
    code = f"import deepinfer; from {module} import {function} as check; check()"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and "BITWISE OK" in proc.stdout, proc.stderr[-3000:]
