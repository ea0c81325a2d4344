"""The PJRT plugin path, for real: PyPI's xla-cpu-pjrt (a CPU PJRT plugin library, test-only) registered
under Ascend's platform name ``npu`` and the bundled model run end to end on it through LLM(); and the
clear errors of a missing, absent or broken plugin. Each run is a fresh process: the platform is chosen
before JAX starts its backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer.runtime.platform import PlatformError, require_feature

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plugin_library() -> str:
    import xla_plugins.xla_cpu_pjrt as plugin  # the test extra's xla-cpu-pjrt wheel

    return os.path.join(os.path.dirname(plugin.__file__), "xla_cpu_pjrt.so")


def _run(args, **env):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("DEEPINFER_PLATFORM", "DEEPINFER_PJRT_PLUGIN", "JAX_PLATFORMS", "PJRT_NAMES_AND_LIBRARY_PATHS")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=600)


def _tokens(**env):
    proc = _run(["-m", "tests.pjrt_run"], **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bundled_model_on_the_plugin_equals_the_cpu_backend():
    on_cpu = _tokens()
    on_npu = _tokens(DEEPINFER_PLATFORM="npu", DEEPINFER_PJRT_PLUGIN=_plugin_library())
    assert on_cpu["platform"] == "cpu" and on_npu["platform"] == "npu"
    # the devices really are the plugin's (a PJRT C API client), not JAX's built-in CPU client
    assert on_npu["client"].startswith("PJRT C API") and not on_cpu["client"].startswith("PJRT C API")
    # the npu platform runs the references (Pallas does not lower there), and says so
    assert on_npu["kernels"] == "attention=ref, indexer=ref, moe=ref"
    assert any(len(t) > 3 for t in on_cpu["tokens"])
    assert on_npu["tokens"] == on_cpu["tokens"]


SELECT = "from deepinfer.runtime.platform import select_platform; import sys; select_platform(*sys.argv[1:])"


@pytest.mark.parametrize("args, message", [
    (["npu"], "platform 'npu': no PJRT plugin is registered under that name"),
    (["npu", "/nonexistent/libpjrt_npu.so"], "the PJRT plugin library '/nonexistent/libpjrt_npu.so' does not exist"),
], ids=["no_plugin", "missing_library"])
def test_missing_plugin_is_one_clear_error(args, message):
    proc = _run(["-c", SELECT, *args])
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "not in the list of known backends" not in proc.stderr


def test_broken_plugin_library_is_one_clear_error(tmp_path):
    bad = tmp_path / "libpjrt_npu.so"
    bad.write_text("not a shared library")
    proc = _run(["-c", SELECT, "npu", str(bad)])
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert f"platform 'npu': the PJRT plugin ({bad}) failed to start" in proc.stderr


def test_server_refuses_a_missing_plugin_at_start():
    proc = _run(["-m", "deepinfer.serve", "--platform", "npu", "--pjrt-plugin", "/nonexistent/lib.so"])
    assert proc.returncode == 2
    assert "error: platform 'npu': the PJRT plugin library '/nonexistent/lib.so' does not exist" in proc.stderr


def test_features_gate_per_platform():
    require_feature("batch-invariant mode", "cpu")
    require_feature("batch-invariant mode", "gpu")
    with pytest.raises(PlatformError, match="batch-invariant mode is not supported on platform 'npu'"):
        require_feature("batch-invariant mode", "npu")


def test_a_platform_asked_for_after_jax_started_is_refused_by_name():
    import jax

    from deepinfer.runtime.platform import select_platform

    jax.devices()  # this process's backends are up (CPU)
    assert select_platform("cpu") == "cpu" and select_platform(None) == "cpu"
    with pytest.raises(PlatformError, match="platform 'npu' was asked for after JAX had started its backends on 'cpu'"):
        select_platform("npu")
