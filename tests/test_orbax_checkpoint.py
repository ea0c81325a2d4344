"""Orbax checkpoints: bitwise round trips (quantized leaves too), resharding on restore, MTP, errors, convert CLI."""

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.models.deepseek_v4.loader import (
    CheckpointError,
    load_checkpoint,
    save_official,
)
from deepinfer.orbax_io import MANIFEST, is_orbax_checkpoint, load_orbax, save_orbax
from deepinfer.params import flatten_dotted, init_params, unflatten_dotted
from deepinfer.quant.formats import QuantizedArray
from deepinfer.quant.quantize import quantize_fp4_group, quantize_fp8_block
from tests.subprocess_env import cpu_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8_PATH, FP4_PATH = "layers.0.attn.wq_b", "layers.2.ffn.experts.w1"


@pytest.fixture(scope="module")
def cfg():
    # 8 experts so that the 8-device "ep" layout divides them.
    return ModelConfig.from_json_file(os.path.join(ROOT, "configs/tiny_mixed.json")).replace(n_routed_experts=8)


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(model_spec(cfg, include_mtp=True), jax.random.key(0))


def quantize_two(params):
    """The tree with one FP8 (block 128x128) and one FP4 (group 32) weight kept quantized."""
    flat = dict(flatten_dotted(params))
    q, s = quantize_fp8_block(np.asarray(flat[FP8_PATH]))
    flat[FP8_PATH] = QuantizedArray(jnp.asarray(q), jnp.asarray(np.asarray(s).view(np.uint8)), "fp8_block", (128, 128), jnp.float32)
    q, s = quantize_fp4_group(np.asarray(flat[FP4_PATH]))
    flat[FP4_PATH] = QuantizedArray(
        jnp.asarray(np.asarray(q).view(np.uint8)), jnp.asarray(np.asarray(s).view(np.uint8)), "fp4_group", (1, 32), jnp.float32
    )
    return unflatten_dotted(params, flat)


def assert_bitwise(a, b):
    fa, fb = flatten_dotted(a), flatten_dotted(b)
    assert list(fa) == list(fb)
    for path in fa:
        x, y = fa[path], fb[path]
        if isinstance(x, QuantizedArray):
            assert isinstance(y, QuantizedArray), path
            assert (x.kind, x.block, x.dtype) == (y.kind, y.block, y.dtype), path
            pairs = [(x.data, y.data), (x.scale, y.scale)]
        else:
            pairs = [(x, y)]
        for u, v in pairs:
            assert u.dtype == v.dtype, path
            assert np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8)), path


@pytest.fixture(scope="module")
def saved(cfg, params, tmp_path_factory):
    """One checkpoint with MTP and two quantized weights, shared by the read-only tests."""
    directory = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    save_orbax(directory, cfg, quantize_two(params))
    return directory


def test_async_round_trip_is_bitwise_with_quantized_leaves(cfg, params, tmp_path):
    tree = quantize_two(params)
    directory = tmp_path / "ckpt"
    pending = save_orbax(directory, cfg, tree, wait=False)
    assert not is_orbax_checkpoint(directory)  # the manifest marks a finished save, written by wait()
    pending.wait()
    pending.wait()  # idempotent
    assert is_orbax_checkpoint(directory)
    assert ModelConfig.from_json_file(directory) == cfg
    leaves = json.loads((directory / MANIFEST).read_text())["leaves"]
    assert leaves[FP4_PATH] == {
        "kind": "fp4_group", "block": [1, 32], "dtype": "float32",
        "data": {"shape": [8, 20, 16], "dtype": "uint8"}, "scale": {"shape": [8, 20, 1], "dtype": "uint8"},
    }
    assert leaves["layers.0.ffn.gate.tid2eid"] == {"shape": [96, 2], "dtype": "int32"}
    got_cfg, got = load_orbax(directory)
    assert got_cfg == cfg
    assert_bitwise(tree, got)
    assert all(a.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0]) for a in jax.tree.leaves(got))


def test_dtype_casts_only_model_dtype_leaves(cfg, params, saved):
    calls = {}

    def shardings(path, shape, dtype):
        calls[path] = (shape, jnp.dtype(dtype))
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    _, got = load_orbax(saved, dtype=jnp.bfloat16, shardings=shardings)
    flat, want = flatten_dotted(got), flatten_dotted(quantize_two(params))
    assert flat["embed"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(flat["embed"]), np.asarray(want["embed"].astype(jnp.bfloat16)))
    assert flat["layers.0.attn_norm"].dtype == jnp.float32  # pinned float32
    assert flat["layers.0.ffn.gate.tid2eid"].dtype == jnp.int32
    assert flat[FP8_PATH].dtype == jnp.bfloat16 and flat[FP8_PATH].data.dtype == jnp.float8_e4m3fn
    assert np.array_equal(np.asarray(flat[FP8_PATH].data), np.asarray(want[FP8_PATH].data))
    assert calls[FP4_PATH] == ((8, 20, 32), jnp.dtype(jnp.bfloat16))  # a quantized weight's logical shape
    assert set(calls) == set(flat)


def test_mtp_skip_and_require(cfg, params, saved, tmp_path):
    _, skipped = load_orbax(saved, mtp="skip")
    assert "mtp" not in skipped
    full = quantize_two(params)
    assert_bitwise({k: v for k, v in full.items() if k != "mtp"}, skipped)
    assert "mtp" in load_orbax(saved, mtp="require")[1]

    no_mtp = {k: v for k, v in params.items() if k != "mtp"}
    save_orbax(tmp_path / "nomtp", cfg, no_mtp)
    assert "mtp" not in load_orbax(tmp_path / "nomtp")[1]
    with pytest.raises(CheckpointError, match=r"nomtp: the checkpoint has no MTP weights \(mtp\.\*\)"):
        load_orbax(tmp_path / "nomtp", mtp="require")


def _copy(saved, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def test_missing_manifest_or_params_folder(saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"empty: not a deepinfer orbax checkpoint \(no deepinfer_checkpoint\.json"):
        os.makedirs(tmp_path / "empty")
        load_orbax(tmp_path / "empty")
    broken = _copy(saved, tmp_path)
    shutil.rmtree(broken / "params")
    with pytest.raises(CheckpointError, match=r"copy: the manifest is there but the params/ folder is missing"):
        load_orbax(broken)


def test_manifest_that_does_not_fit_the_config_names_the_paths(saved, tmp_path):
    broken = _copy(saved, tmp_path)
    manifest = json.loads((broken / MANIFEST).read_text())
    del manifest["leaves"]["layers.0.attn.wq_a"]
    manifest["leaves"]["layers.1.attn.wkv"]["shape"] = [17, 32]
    manifest["leaves"]["layers.1.attn_norm"]["dtype"] = "bfloat16"
    manifest["leaves"]["layers.9.extra"] = {"shape": [1], "dtype": "float32"}
    (broken / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as err:
        load_orbax(broken)
    msg = str(err.value)
    assert "does not match its config.json" in msg
    assert "missing (1): layers.0.attn.wq_a" in msg
    assert "unexpected (1): layers.9.extra" in msg
    assert "layers.1.attn.wkv (saved (17, 32), config expects (16, 32))" in msg
    assert "layers.1.attn_norm (saved bfloat16, must be float32)" in msg


def test_manifest_from_another_save_is_refused_naming_the_array(saved, tmp_path):
    broken = _copy(saved, tmp_path)
    manifest = json.loads((broken / MANIFEST).read_text())
    manifest["leaves"]["embed"]["dtype"] = "bfloat16"  # fits the config (model dtype), not the stored array
    (broken / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"orbax arrays do not match the manifest: mismatched \(1\): embed \(stored \(96, 32\) float32, manifest \(96, 32\) bfloat16\)"):
        load_orbax(broken)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_orbax_folder(saved, tmp_path):
    broken = _copy(saved, tmp_path)
    data = [os.path.join(d, f) for d, _, files in os.walk(broken / "params") for f in files if f"{os.sep}d{os.sep}" in os.path.join(d, f)]
    biggest = max(data, key=os.path.getsize)  # array bytes; orbax's metadata lives in the small files
    os.truncate(biggest, os.path.getsize(biggest) // 2)
    with pytest.raises(CheckpointError, match=r"params: unreadable or truncated orbax checkpoint \(ValueError: OUT_OF_RANGE: Error reading \"[a-z0-9_.]+/"):
        load_orbax(broken)
    broken2 = _copy(saved, tmp_path / "b")
    os.remove(broken2 / "params" / "_METADATA")
    with pytest.raises(CheckpointError, match=r"params: unreadable or truncated orbax checkpoint \(its array metadata cannot be read\)"):
        load_orbax(broken2)
    gc.collect()  # orbax's failed reads leave callbacks for a closed event loop; let them go here, not in later tests


def test_save_refuses_an_existing_checkpoint(cfg, params, saved):
    with pytest.raises(FileExistsError, match=r"params already exists"):
        save_orbax(saved, cfg, params)


RESHARD = textwrap.dedent(
    """
    import sys, jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P, SingleDeviceSharding
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.orbax_io import load_orbax, save_orbax
    from deepinfer.weight_placement import part_sharding
    from deepinfer.params import flatten_dotted, unflatten_dotted
    from deepinfer.quant.formats import QuantizedArray
    from sharding.rules import PRESETS, param_shardings, shard_params
    src, dst = sys.argv[1:]
    cfg, ref = load_orbax(src)
    spec = model_spec(cfg, include_mtp=True)
    flat = flatten_dotted(ref)

    def place(leaf, s):  # shard_params for plain leaves; a quantized weight's parts follow its sharding
        if isinstance(leaf, QuantizedArray):
            return QuantizedArray(jax.device_put(leaf.data, part_sharding(s, leaf.data.shape)),
                                  jax.device_put(leaf.scale, part_sharding(s, leaf.scale.shape)),
                                  leaf.kind, leaf.block, leaf.dtype)
        return shard_params(leaf, s)

    mesh24 = Mesh(np.array(jax.devices()).reshape(2, 4), ("ep", "tp"))
    tp_ep = flatten_dotted(param_shardings(spec, mesh24, PRESETS["tp_ep"]))
    placed = {p: place(v, tp_ep[p]) for p, v in flat.items()}
    assert placed["layers.2.ffn.experts.w1"].data.sharding.spec == P("ep", "tp", None)
    assert placed["layers.0.attn.wq_b"].data.sharding.spec == P("tp", None)
    assert placed["layers.0.attn.wq_b"].scale.sharding.spec == P()  # 1 scale row cannot split 4 ways
    assert len(placed["embed"].sharding.device_set) == 8
    save_orbax(dst, cfg, unflatten_dotted(ref, placed))

    mesh8 = Mesh(np.array(jax.devices()), ("ep",))
    ep = flatten_dotted(param_shardings(spec, mesh8, PRESETS["ep"]))
    for shardings in (ep, None):
        _, got = load_orbax(dst, shardings=shardings)
        got = flatten_dotted(got)
        assert list(got) == list(flat)
        for p, v in flat.items():
            want = ep[p] if shardings else SingleDeviceSharding(jax.devices()[0])
            pairs = [(v, got[p], want)]
            if isinstance(v, QuantizedArray):
                pairs = [(v.data, got[p].data, part_sharding(want, v.data.shape)),
                         (v.scale, got[p].scale, part_sharding(want, v.scale.shape))]
            for a, b, s in pairs:
                assert a.dtype == b.dtype, p
                assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), p
                assert b.sharding == s, (p, b.sharding, s)
    assert len(got["layers.2.ffn.experts.w1"].data.sharding.device_set) == 1
    print("RESHARD_OK")
    """
)


def test_restore_onto_another_device_layout(saved, tmp_path):
    """Saved from tp_ep on a (2, 4) mesh, restored with ep on 8 devices and on one device (a fresh
    process: the fake device count is fixed at start-up)."""
    env = cpu_devices_env(8, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", RESHARD, saved, str(tmp_path / "tp_ep")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESHARD_OK" in proc.stdout


def _convert(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "deepinfer.convert", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_convert_cli_both_directions(cfg, params, tmp_path):
    st = tmp_path / "st"
    save_official(cfg, params, st)
    (st / "tokenizer.json").write_text("{}")
    proc = _convert(st, tmp_path / "orb")
    assert proc.returncode == 0, proc.stderr
    assert "(safetensors) ->" in proc.stdout and "(orbax):" in proc.stdout and "tensors" in proc.stdout
    assert is_orbax_checkpoint(tmp_path / "orb") and (tmp_path / "orb" / "tokenizer.json").exists()
    assert_bitwise(params, load_orbax(tmp_path / "orb")[1])

    proc = _convert(tmp_path / "orb", tmp_path / "back")
    assert proc.returncode == 0, proc.stderr
    assert "(orbax) ->" in proc.stdout and "(safetensors):" in proc.stdout
    assert (tmp_path / "back" / "tokenizer.json").exists()
    back_cfg, back = load_checkpoint(tmp_path / "back")
    assert back_cfg == cfg
    assert_bitwise(params, back)


def test_convert_cli_bad_source_is_one_line_exit_2(tmp_path):
    os.makedirs(tmp_path / "nothing")
    proc = _convert(tmp_path / "nothing", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "nothing: not a checkpoint folder (no deepinfer_checkpoint.json and no *.safetensors file)" in proc.stderr
    assert not os.path.exists(tmp_path / "out")


def test_convert_orbax_to_orbax_casts_and_dequantizes(params, saved, tmp_path):
    """In-process (no start-up cost): --to orbax from an orbax source, with --dtype and --quantized-weights."""
    from deepinfer.convert import main

    assert main([saved, str(tmp_path / "bf16"), "--to", "orbax", "--dtype", "bfloat16"]) == 0
    flat = flatten_dotted(load_orbax(tmp_path / "bf16")[1])
    assert flat["embed"].dtype == jnp.bfloat16 and flat["layers.0.attn_norm"].dtype == jnp.float32
    assert isinstance(flat[FP8_PATH], QuantizedArray) and flat[FP8_PATH].dtype == jnp.bfloat16

    assert main([saved, str(tmp_path / "plain"), "--to", "orbax", "--quantized-weights", "dequantize"]) == 0
    flat = flatten_dotted(load_orbax(tmp_path / "plain")[1])
    quantized = flatten_dotted(quantize_two(params))
    for path in (FP8_PATH, FP4_PATH):
        assert not isinstance(flat[path], QuantizedArray)
        assert np.array_equal(np.asarray(flat[path]), np.asarray(quantized[path].astype(jnp.float32)))
