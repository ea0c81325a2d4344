"""Loading checkpoints: transformers save_pretrained, official naming, and clear errors."""

import copy
import json
import os

import jax
import numpy as np
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4 import forward
from deepinfer.models.deepseek_v4.loader import (
    CheckpointError,
    load_checkpoint,
    load_params,
    save_official,
)
from deepinfer.params import flatten_dotted
from deepinfer.safetensors_io import SafetensorsFile, save_file
from tests.reference import load_case, reference_logits

TOLERANCE = 1e-4


def _logits(cfg, params, tokens):
    return np.asarray(jax.jit(forward, static_argnums=0)(cfg, params, tokens))


def _assert_close_to_reference(case, cfg, params):
    ref = reference_logits(case.model, case.tokens)
    ours = _logits(cfg, params, case.tokens)
    assert np.max(np.abs(ours - ref)) <= TOLERANCE * np.max(np.abs(ref))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    case = load_case("mixed")
    path = tmp_path_factory.mktemp("hf_ckpt")
    case.model.save_pretrained(path)
    return path


def test_save_pretrained_roundtrip(hf_dir):
    case = load_case("mixed")
    cfg, params = load_checkpoint(hf_dir)
    assert cfg == case.cfg
    assert "mtp" not in params  # transformers drops MTP weights
    _assert_close_to_reference(case, cfg, params)


def test_official_naming_roundtrip(tmp_path):
    """Same weights written under the official names and config spelling load to the same model."""
    case = load_case("mixed")
    save_official(case.cfg, case.params, tmp_path)
    names = SafetensorsFile(tmp_path / "model.safetensors").keys()
    assert "embed.weight" in names and "layers.1.attn.indexer.compressor.wkv.weight" in names
    assert "layers.2.ffn.experts.5.w3.weight" in names and "layers.0.hc_attn_fn" in names
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "compress_ratios" in raw and "layer_types" not in raw and "num_hash_layers" in raw
    cfg, params = load_checkpoint(tmp_path)
    assert cfg == case.cfg
    for path, value in flatten_dotted(case.params).items():
        np.testing.assert_array_equal(np.asarray(flatten_dotted(params)[path]), np.asarray(value), err_msg=path)
    _assert_close_to_reference(case, cfg, params)


def test_official_mtp_weights_load(tmp_path):
    case = load_case("mixed")
    from deepinfer.models.deepseek_v4.param_tree import model_spec
    from deepinfer.params import init_params

    full = init_params(model_spec(case.cfg), jax.random.key(3))
    save_official(case.cfg, full, tmp_path)
    names = SafetensorsFile(tmp_path / "model.safetensors").keys()
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w1.weight"} <= set(names)
    _, params = load_checkpoint(tmp_path, mtp="require")
    np.testing.assert_array_equal(np.asarray(params["mtp"][0]["h_proj"]), np.asarray(full["mtp"][0]["h_proj"]))
    np.testing.assert_array_equal(
        np.asarray(params["mtp"][0]["block"]["ffn"]["experts"]["w2"]), np.asarray(full["mtp"][0]["block"]["ffn"]["experts"]["w2"])
    )


def test_require_mtp_names_the_missing_tensors(hf_dir):
    with pytest.raises(CheckpointError, match=r"missing: every MTP tensor \(mtp\.0\.e_proj\.weight.*no MTP weights"):
        load_checkpoint(hf_dir, mtp="require")


def _rewrite(src_dir, dst_dir, edit):
    """Copy a checkpoint, letting edit(tensors) change the tensor dict."""
    f = SafetensorsFile(os.path.join(src_dir, "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    edit(tensors)
    os.makedirs(dst_dir, exist_ok=True)
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as a, open(os.path.join(dst_dir, "config.json"), "w") as b:
        b.write(a.read())


def test_missing_tensor_is_named(hf_dir, tmp_path):
    _rewrite(hf_dir, tmp_path, lambda t: t.pop("model.layers.1.attn.indexer.wq_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing \(1\): layers\.1\.attn\.indexer\.wq_b\.weight"):
        load_checkpoint(tmp_path)


def test_missing_expert_is_named(hf_dir, tmp_path):
    _rewrite(hf_dir, tmp_path, lambda t: t.pop("model.layers.2.ffn.experts.4.w2.weight"))
    with pytest.raises(CheckpointError, match=r"missing \(1\): layers\.2\.ffn\.experts\.4\.w2\.weight"):
        load_checkpoint(tmp_path)


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    def edit(t):
        t["model.layers.0.attn.extra_proj.weight"] = np.zeros((2, 2), np.float32)
        # a compressor on a sliding-only layer does not fit the config either
        t["model.layers.0.attn.compressor.wkv.weight"] = np.zeros((32, 32), np.float32)

    _rewrite(hf_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    msg = str(info.value)
    assert "unexpected (2)" in msg
    assert "model.layers.0.attn.extra_proj.weight (not a DeepSeek-V4 weight name)" in msg
    assert "model.layers.0.attn.compressor.wkv.weight (no layers.0.attn.compressor.wkv in this config: layer 0 is sliding_attention" in msg


def test_misshaped_tensor_is_named(hf_dir, tmp_path):
    _rewrite(hf_dir, tmp_path, lambda t: t.update({"model.layers.3.attn.wo_b.weight": np.zeros((32, 13), np.float32)}))
    with pytest.raises(CheckpointError, match=r"mis-shaped \(1\): model\.layers\.3\.attn\.wo_b\.weight: expected \(32, 24\), got \(32, 13\)"):
        load_checkpoint(tmp_path)


def test_scale_beside_a_float_weight_is_named(hf_dir, tmp_path):
    """A scale whose weight is not FP8 / FP4 is a broken checkpoint, reported once (not also as missing)."""
    _rewrite(hf_dir, tmp_path, lambda t: t.update({"model.layers.0.attn.wq_a.scale": np.ones((1, 1), np.float32)}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert str(info.value) == (
        "checkpoint does not match the config: badly quantized (1): model.layers.0.attn.wq_a.weight: has a scale "
        "but dtype float32; quantized weights are float8_e4m3fn (FP8) or int8 / F4 (packed FP4)"
    )


def test_bf16_checkpoint_loads_as_bf16(hf_dir, tmp_path):
    case = load_case("mixed")
    copy.deepcopy(case.model).to(torch.bfloat16).save_pretrained(tmp_path)  # the cached model stays untouched
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert str(f.dtype("model.layers.0.attn.wq_a.weight")) == "bfloat16"
    cfg = ModelConfig.from_json_file(tmp_path)
    params = load_params(cfg, tmp_path, dtype="bfloat16")
    assert params["layers"][0]["attn"]["wq_a"].dtype == "bfloat16"
    assert params["layers"][0]["attn"]["sink"].dtype == "float32"  # kept fp32 like the reference
    assert params["layers"][0]["ffn"]["gate"]["tid2eid"].dtype == "int32"
    expected = np.asarray(case.params["layers"][0]["attn"]["wq_a"]).astype("bfloat16")
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["attn"]["wq_a"]), expected)
