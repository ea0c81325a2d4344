"""The official FP8 / FP4 checkpoint format: both load modes, several shards, and named errors.

No release can be downloaded here, so the checkpoint is made from a random tiny
model, quantized with the release's layout (deepinfer/quant/quantize.py): FP8
e4m3 attention / shared-expert linears with 128x128 ue8m0 block scales, FP4 e2m1
routed experts packed two per int8 byte with per-32 ue8m0 scales, the rest bf16 /
fp32, split over several shards with an index. The moe intermediate size is 32
(tiny_mixed has 20) because FP4 groups need the input width to be a multiple of 32.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.llm import LLM
from deepinfer.models.deepseek_v4 import forward
from deepinfer.models.deepseek_v4.loader import (
    CheckpointError,
    load_checkpoint,
    save_official,
)
from deepinfer.models.deepseek_v4.weight_names import resolve
from deepinfer.params import flatten_dotted
from deepinfer.quant.formats import FP4_GROUP, FP8_BLOCK, QuantizedArray, dequantize_np
from deepinfer.quant.quantize import (
    quantize_fp4_group,
    quantize_fp8_block,
    quantize_like_release,
)
from deepinfer.safetensors_io import SafetensorsFile, save_file
from tests.reference import (
    TINY_CONFIGS,
    params_from_torch,
    random_tokens,
    randomize_,
    reference_logits,
)
from tests.subprocess_env import cpu_devices_env

TOLERANCE = 1e-4  # fp32 logits against transformers, as in test_loader.py


@pytest.fixture(scope="module")
def quant_case():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = copy.deepcopy(TINY_CONFIGS["mixed"])
    raw["moe_intermediate_size"] = 32
    hf = DeepseekV4Config(**raw, attn_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf).eval()
    randomize_(model, 0)
    cfg = ModelConfig.from_dict(hf.to_dict())
    return model, cfg, params_from_torch(cfg, model, mtp="skip")


@pytest.fixture(scope="module")
def release_dir(quant_case, tmp_path_factory):
    _, cfg, params = quant_case
    path = tmp_path_factory.mktemp("fp8_fp4_release")
    save_official(cfg, quantize_like_release(params), path, max_shard_bytes=120_000)
    return path


def _logits(cfg, params, tokens):
    return np.asarray(jax.jit(forward, static_argnums=0)(cfg, params, tokens))


def _transformers_dequantized(directory) -> dict[str, np.ndarray]:
    """Every weight of the checkpoint dequantized by transformers' own FP8 / FP4 code (an independent reader)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)
    files = [SafetensorsFile(os.path.join(directory, n)) for n in sorted(os.listdir(directory)) if n.endswith(".safetensors")]
    tensors = {k: f.get(k) for f in files for k in f.keys()}
    out = {}
    for name, value in tensors.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in tensors:
            continue
        scale = tensors.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is None:
            out[name] = np.asarray(value, np.float32) if value.dtype.kind == "f" or value.dtype == ml_dtypes.bfloat16 else value
            continue
        q = torch.from_numpy(np.array(value).view(np.int8 if value.dtype == np.int8 else np.uint8))
        if value.dtype == ml_dtypes.float8_e4m3fn:
            q = q.view(torch.float8_e4m3fn)
        s = torch.from_numpy(np.array(scale).view(np.uint8))  # ue8m0 bytes, as transformers reads MXFP8 scales
        out[name] = deq._dequantize_one(q, s, output_dtype=torch.float32).numpy()
    return out


def test_dequantizer_matches_transformers_on_whole_blocks():
    """Shapes of several 128x128 blocks (FP8) and several 32-groups (FP4), float and ue8m0 scales."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)
    w = np.random.default_rng(0).normal(size=(256, 384)).astype(np.float32) * np.linspace(0.01, 3, 384, dtype=np.float32)
    for scale_fmt in ("ue8m0", "float"):
        q, s = quantize_fp8_block(w, scale_fmt)
        assert s.shape == (2, 3)
        theirs = deq._dequantize_one(torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn),
                                     torch.from_numpy(np.asarray(s, np.float32)), output_dtype=torch.float32).numpy()
        np.testing.assert_array_equal(dequantize_np(q, s, FP8_BLOCK, (128, 128)), theirs)
        assert np.abs(theirs - w).max() <= np.abs(w).max() * 2**-3  # e4m3 keeps 3 mantissa bits
    q4, s4 = quantize_fp4_group(w)
    assert q4.dtype == np.int8 and q4.shape == (256, 192) and s4.shape == (256, 12)
    theirs = deq._dequantize_one(torch.from_numpy(q4), torch.from_numpy(np.asarray(s4).view(np.uint8)),
                                 output_dtype=torch.float32).numpy()
    np.testing.assert_array_equal(dequantize_np(q4, s4, FP4_GROUP, (1, 32)), theirs)


def test_release_layout_on_disk(release_dir):
    index = json.loads((release_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    f = {k: SafetensorsFile(release_dir / shard) for k, shard in index["weight_map"].items()}
    assert str(f["layers.0.attn.wq_a.weight"].dtype("layers.0.attn.wq_a.weight")) == "float8_e4m3fn"
    assert f["layers.0.attn.wq_a.scale"].shape("layers.0.attn.wq_a.scale") == (1, 1)
    assert str(f["layers.0.attn.wq_a.scale"].dtype("layers.0.attn.wq_a.scale")) == "float8_e8m0fnu"
    assert f["layers.2.ffn.experts.3.w2.weight"].shape("layers.2.ffn.experts.3.w2.weight") == (32, 16)  # [D, I/2]
    assert str(f["layers.2.ffn.experts.3.w2.weight"].dtype("layers.2.ffn.experts.3.w2.weight")) == "int8"
    assert f["layers.2.ffn.experts.3.w2.scale"].shape("layers.2.ffn.experts.3.w2.scale") == (32, 1)
    assert str(f["layers.1.attn.compressor.wkv.weight"].dtype("layers.1.attn.compressor.wkv.weight")) == "float32"
    config = json.loads((release_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"


def test_dequantize_on_load_equals_reference_on_dequantized_weights(quant_case, release_dir):
    """Loaded weights equal transformers' dequantization bitwise; logits equal the reference model run
    on those weights within fp32 tolerance."""
    model, cfg, _ = quant_case
    theirs = _transformers_dequantized(release_dir)
    loaded_cfg, params = load_checkpoint(release_dir)
    assert loaded_cfg == cfg
    flat = flatten_dotted(params)
    np.testing.assert_array_equal(np.asarray(flat["layers.0.attn.wq_a"]), theirs["layers.0.attn.wq_a.weight"])
    np.testing.assert_array_equal(np.asarray(flat["layers.2.ffn.experts.w2"])[3], theirs["layers.2.ffn.experts.3.w2.weight"])

    reference = copy.deepcopy(model)
    state = reference.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            ref = resolve(name)
            if ref is None or ref.path not in flat:
                continue
            value = np.asarray(flat[ref.path])
            if ref.fused_halves is not None:
                value = np.concatenate([np.asarray(flat[p]) for p in ref.fused_halves], axis=1)
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(tensor.dtype))
    tokens = random_tokens("mixed")
    ref_logits = reference_logits(reference, tokens)
    ours = _logits(cfg, params, tokens)
    assert np.max(np.abs(ours - ref_logits)) <= TOLERANCE * np.max(np.abs(ref_logits))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_quantized_equals_dequantized_bitwise(release_dir, dtype):
    """Every e4m3 / e2m1 value times a power-of-two scale is exact in bf16 and fp32, so dequantizing inside
    the program gives the very weights dequantize-on-load gives, and the same logits, bit for bit."""
    cfg, kept = load_checkpoint(release_dir, dtype=dtype, quantized_weights="keep")
    _, loaded = load_checkpoint(release_dir, dtype=dtype)
    flat = flatten_dotted(kept)
    experts = flat["layers.2.ffn.experts.w1"]
    assert isinstance(experts, QuantizedArray) and experts.kind == FP4_GROUP and experts.data.dtype == np.uint8
    assert experts.scale.dtype == np.uint8 and experts.dtype == np.dtype(dtype)
    assert isinstance(flat["layers.0.attn.wq_b"], QuantizedArray) and flat["layers.0.attn.wq_b"].kind == FP8_BLOCK
    assert not isinstance(flat["embed"], QuantizedArray)
    tokens = random_tokens("mixed")
    np.testing.assert_array_equal(_logits(cfg, kept, tokens), _logits(cfg, loaded, tokens))
    # FP4 experts: 4 bits per weight plus one scale byte per 32 -> 4.25 bits, against bf16's 16
    assert experts.nbytes * 8 / np.prod(experts.shape) == 4.25


def test_shards_load_like_one_file(release_dir, tmp_path):
    cfg, sharded = load_checkpoint(release_dir, quantized_weights="keep")
    save_official(cfg, sharded, tmp_path)  # kept-quantized weights write back in the release's layout
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    _, single = load_checkpoint(tmp_path, quantized_weights="keep")
    for path, a in flatten_dotted(sharded).items():
        b = flatten_dotted(single)[path]
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), path


def test_llm_serves_the_quantized_checkpoint_in_both_modes(release_dir):
    """End to end through LLM(): greedy tokens of the kept-quantized model equal the dequantized one's."""
    kw = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48, page_size=4, token_buckets=(16,),
              row_buckets=(2,), warmup=False)
    prompts = [{"prompt_token_ids": [3, 17, 42, 5, 9]}, {"prompt_token_ids": [60, 2, 2, 71]}]
    from deepinfer.scheduler.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("dequantize", "keep"):
        llm = LLM(str(release_dir), quantized_weights=mode, **kw)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["keep"] == outs["dequantize"]
    assert all(len(t) == 8 for t in outs["keep"])


def test_llm_keeps_quantized_weights_on_a_mesh(release_dir):
    """LLM(quantized_weights="keep") on a TP2 + EP2 mesh (2 fake devices, a fresh process): each weight's
    data and scales are read straight into their split (placing the tree on the mesh afterwards moves
    nothing), FP8 linears and FP4 experts are split rather than copied whole, and the greedy tokens are
    those of the same checkpoint on one device."""
    script = textwrap.dedent(
        f"""
        import json
        import sharding.placement as placement
        from deepinfer.llm import LLM
        from deepinfer.scheduler.sampling_params import SamplingParams
        moved, put = [], placement._put
        def spy(a, s):
            if a.sharding != s:
                moved.append(list(a.shape))
            return put(a, s)
        placement._put = spy
        kw = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48, page_size=4, token_buckets=(16,),
                  row_buckets=(2,), warmup=False, show_progress=False, quantized_weights="keep")
        prompts = [{{"prompt_token_ids": [3, 17, 42, 5, 9]}}, {{"prompt_token_ids": [60, 2, 2, 71]}}]
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        one = LLM({str(release_dir)!r}, **kw)
        want = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
        mesh = LLM({str(release_dir)!r}, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
        got = [o.outputs[0].token_ids for o in mesh.generate(prompts, sp, use_tqdm=False)]
        layer = mesh.engine.params["layers"][2]
        split = lambda a: [list(x.data.shape) for x in a.addressable_shards]
        print("RESULT " + json.dumps({{"moved": moved, "want": want, "got": got,
            "experts": list(layer["ffn"]["experts"]["w1"].data.shape), "experts_shards": split(layer["ffn"]["experts"]["w1"].data),
            "wq_b": list(layer["attn"]["wq_b"].data.shape), "wq_b_shards": split(layer["attn"]["wq_b"].data)}}))
        """
    )
    env = cpu_devices_env(2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert r["moved"] == []
    assert r["got"] == r["want"] and all(len(t) == 8 for t in r["got"])
    e, shards = r["experts"], r["experts_shards"]
    assert shards == [[e[0] // 2, *e[1:]]] * 2  # FP4 experts: half the experts on each device
    q, shards = r["wq_b"], r["wq_b_shards"]
    assert shards == [[q[0] // 2, *q[1:]]] * 2  # FP8 query projection: split by heads, not copied whole


# ---- bad input: each names the problem, nothing is loaded ----------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_missing_shard_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    shard = sorted(set(_index(d)["weight_map"].values()))[1]
    os.remove(d / shard)
    with pytest.raises(CheckpointError, match=rf"shard {shard} is missing \(it holds \d+ tensors, e\.g\. "):
        load_checkpoint(d)


def test_bad_index_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: unreadable index"):
        load_checkpoint(d)
    index = _index(release_dir)
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"]["embed.weight"])
    index["weight_map"]["embed.weight"] = wrong
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"maps 1 tensors to shards that do not hold them, e\.g\. embed\.weight -> {wrong}"):
        load_checkpoint(d)


def _rewrite_shard_of(d, tensor, edit):
    shard = _index(d)["weight_map"][tensor]
    f = SafetensorsFile(d / shard)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    edit(tensors)
    save_file(tensors, d / shard)


def test_wrong_scale_shape_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    _rewrite_shard_of(d, "layers.2.ffn.experts.1.w1.scale",
                      lambda t: t.update({"layers.2.ffn.experts.1.w1.scale": np.ones((32, 3), ml_dtypes.float8_e8m0fnu)}))
    with pytest.raises(CheckpointError, match=r"badly quantized \(1\): layers\.2\.ffn\.experts\.1\.w1\.weight: FP4 scale "
                                              r"shape \(32, 3\) does not divide the unpacked weight \(32, 32\) into row groups"):
        load_checkpoint(d)
    # a valid layout (groups of 16) that differs from the layer's other experts
    _rewrite_shard_of(d, "layers.2.ffn.experts.1.w1.scale",
                      lambda t: t.update({"layers.2.ffn.experts.1.w1.scale": np.ones((32, 2), ml_dtypes.float8_e8m0fnu)}))
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.1\.w1\.weight: stored unlike expert 0 of its layer"):
        load_checkpoint(d)


def test_fp8_weight_without_scale_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    index = _index(d)
    del index["weight_map"]["layers.1.attn.wo_b.scale"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite_shard_of(d, "layers.1.attn.wo_b.weight", lambda t: t.pop("layers.1.attn.wo_b.scale"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wo_b\.weight: an FP8 weight without its scale "
                                              r"\(layers\.1\.attn\.wo_b\.scale\)"):
        load_checkpoint(d)


def test_nan_scale_is_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    _rewrite_shard_of(d, "layers.0.attn.wq_b.scale",
                      lambda t: t.update({"layers.0.attn.wq_b.scale": np.full((1, 1), 255, np.uint8).view(ml_dtypes.float8_e8m0fnu)}))
    for mode in ("dequantize", "keep"):
        with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_b\.weight: its ue8m0 scale holds 0xFF \(NaN\)"):
            load_checkpoint(d, quantized_weights=mode)


def _edit_header(path, edit):
    """Rewrite a safetensors header in place (data offsets are relative to the data section, which stays)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n :])


def test_unknown_dtype_and_truncated_file_are_named(release_dir, tmp_path):
    d = _copy(release_dir, tmp_path / "c")
    shard = d / _index(d)["weight_map"]["embed.weight"]
    _edit_header(shard, lambda h: h["embed.weight"].update(dtype="C64"))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor 'embed\.weight' has unsupported dtype C64"):
        load_checkpoint(d)
    d2 = _copy(release_dir, tmp_path / "t")
    shard = sorted(d2.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor '.+' ends at byte \d+ of the data section, but the "
                                              r"file has only \d+ \(truncated file\?\)"):
        load_checkpoint(d2)


def test_packed_f4_dtype_reads_as_the_int8_layout(tmp_path):
    """safetensors' F4 code counts values, not bytes; it reads as the release's packed bytes."""
    q, _ = quantize_fp4_group(np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32))
    save_file({"w": q}, tmp_path / "x.safetensors")
    _edit_header(tmp_path / "x.safetensors", lambda h: h["w"].update(dtype="F4", shape=[4, 64]))
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.shape("w") == (4, 32) and f.dtype("w") == np.uint8
    np.testing.assert_array_equal(f.get("w"), q.view(np.uint8))


def test_streamed_into_a_sharded_target_on_8_devices(release_dir):
    """Each parameter lands directly in its tp_ep sharding (2 x 4 mesh), in both modes, with the logits
    of the single-device load (a fresh process: the device count is fixed at start-up)."""
    script = textwrap.dedent(
        f"""
        import jax, numpy as np
        from jax.sharding import Mesh
        from deepinfer.models.deepseek_v4 import forward, model_spec
        from deepinfer.models.deepseek_v4.loader import load_checkpoint
        from deepinfer.params import flatten_dotted
        from deepinfer.quant.formats import QuantizedArray
        from sharding.rules import PRESETS, param_shardings
        from tests.reference import random_tokens
        path = {str(release_dir)!r}
        cfg, base = load_checkpoint(path)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("ep", "tp"))
        targets = flatten_dotted(param_shardings(model_spec(cfg, include_mtp=False), mesh, PRESETS["tp_ep"]))
        tokens = random_tokens("mixed")
        want = np.asarray(jax.jit(forward, static_argnums=0)(cfg, base, tokens))
        for mode in ("dequantize", "keep"):
            _, params = load_checkpoint(path, quantized_weights=mode, shardings=targets)
            flat = flatten_dotted(params)
            w = flat["layers.2.ffn.experts.w1"]
            data = w.data if mode == "keep" else w
            assert isinstance(w, QuantizedArray) == (mode == "keep")
            assert data.sharding == targets["layers.2.ffn.experts.w1"], data.sharding
            assert len(data.addressable_shards) == 8 and data.addressable_shards[0].data.shape[0] == 3
            for p, leaf in flat.items():
                if not isinstance(leaf, QuantizedArray):
                    assert leaf.sharding == targets[p], p
            got = np.asarray(jax.jit(forward, static_argnums=0)(cfg, params, tokens))
            err = np.abs(got - want).max() / np.abs(want).max()
            print(mode, "REL_ERR", err)
            assert err < 1e-5, (mode, err)
        """
    )
    env = cpu_devices_env(8)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("REL_ERR") == 2


def test_release_to_orbax_and_back_keeps_every_byte(release_dir, tmp_path):
    """python -m deepinfer.convert: FP8 / FP4 release -> orbax (kept quantized) -> safetensors gives the
    release's tensors back byte for byte, and the orbax folder loads through the same entry point."""
    from deepinfer.convert import main
    from deepinfer.model_loading import load_model

    assert main([str(release_dir), str(tmp_path / "orbax"), "--quantized-weights", "keep"]) == 0
    assert main([str(tmp_path / "orbax"), str(tmp_path / "back")]) == 0
    _, kept = load_checkpoint(release_dir, quantized_weights="keep")
    _, restored = load_model(tmp_path / "orbax", quantized_weights="keep")
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    original = {k: SafetensorsFile(release_dir / s).get(k) for k, s in _index(release_dir)["weight_map"].items()}
    back_file = SafetensorsFile(tmp_path / "back" / "model.safetensors")
    assert sorted(back_file.keys()) == sorted(original)
    for name, arr in original.items():
        got = back_file.get(name)
        assert got.dtype == arr.dtype and np.array_equal(got.view(np.uint8), arr.view(np.uint8)), name
