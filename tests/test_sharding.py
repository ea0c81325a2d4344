"""Shardings derive from the abstract parameter tree; a sharded forward equals the unsharded one."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.params import flatten_dotted
from sharding.rules import PRESETS, param_shardings
from tests.reference import deepinfer_config
from tests.subprocess_env import cpu_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_logical_axis_is_known_to_the_presets():
    """A rule names only axes the model declares (a typo would silently replicate)."""
    cfg = deepinfer_config("mixed")
    declared = {a for s in flatten_dotted(model_spec(cfg)).values() for a in s.axes if a}
    for name, rules in PRESETS.items():
        assert set(rules) <= declared, (name, set(rules) - declared)


def test_indivisible_dimension_is_an_error_naming_the_parameter():
    cfg = deepinfer_config("mixed")  # 6 experts
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("ep",))
    param_shardings(model_spec(cfg), mesh, PRESETS["ep"])  # size-1 axis divides everything
    fake = type("FakeMesh", (), {"shape": {"ep": 4}})()
    from sharding.rules import _check_divisible, logical_to_partition_spec

    spec = flatten_dotted(model_spec(cfg))["layers.2.ffn.experts.w1"]
    with pytest.raises(ValueError, match=r"layers\.2\.ffn\.experts\.w1: dimension 0 \(experts, size 6\) is not divisible"):
        _check_divisible("layers.2.ffn.experts.w1", spec, logical_to_partition_spec(spec.axes, PRESETS["ep"]), fake)


def test_sharded_forward_matches_unsharded():
    """On 4 fake CPU devices (a fresh process: the device count is fixed at start-up)."""
    script = textwrap.dedent(
        """
        import jax, numpy as np
        from jax.sharding import Mesh
        from deepinfer.models.deepseek_v4 import forward, model_spec
        from deepinfer.params import init_params
        from sharding.rules import PRESETS, param_shardings, shard_params
        from deepinfer.config import ModelConfig
        cfg = ModelConfig.from_json_file("configs/tiny_mixed.json")
        spec = model_spec(cfg, include_mtp=False)
        params = init_params(spec, jax.random.key(0))
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
        base = np.asarray(jax.jit(forward, static_argnums=0)(cfg, params, tokens))
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("ep", "tp"))
        sharded = shard_params(params, param_shardings(spec, mesh, PRESETS["tp_ep"]))
        assert len(sharded["layers"][2]["ffn"]["experts"]["w1"].sharding.device_set) == 4
        out = np.asarray(jax.jit(forward, static_argnums=0)(cfg, sharded, tokens))
        err = np.abs(out - base).max() / np.abs(base).max()
        print("REL_ERR", err)
        assert err < 1e-5, err
        """
    )
    env = cpu_devices_env(4)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REL_ERR" in proc.stdout
