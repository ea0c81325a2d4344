"""Load DeepSeek-V4 weights from safetensors (transformers or official naming); write official-style.

Every problem is collected and reported at once, naming the tensors: missing
(by official name), unexpected (by on-disk name, with the reason), mis-shaped
(both shapes). Quantized (FP8/FP4) checkpoints are recognised and refused with a
clear message until they are supported.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from deepinfer.config import CSA, HASH_MOE, HCA, SCORE_MOE, SLIDING, ModelConfig
from deepinfer.models.deepseek_v4.param_tree import model_spec
from deepinfer.models.deepseek_v4.weight_names import official_name, resolve
from deepinfer.params import ParamSpec, flatten_dotted, unflatten_dotted
from deepinfer.safetensors_io import open_checkpoint_files, save_file

_MAX_LISTED = 12


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; the message names the tensors."""


def _listing(kind: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{kind} ({len(items)}): {shown}{more}"


def params_from_named_arrays(
    cfg: ModelConfig, named: Mapping[str, Any], dtype: Any = jnp.float32, mtp: str = "auto", progress=None
) -> dict:
    """Build the parameter tree from ``{checkpoint name: array-like}``.

    ``named`` values only need ``.shape`` and ``np.asarray``-ability, and are read
    lazily. ``progress(total, done)`` is called as tensors are converted. ``mtp``: "auto" loads MTP blocks when the checkpoint has them,
    "require" fails without them, "skip" ignores them.
    """
    if mtp not in ("auto", "require", "skip"):
        raise ValueError(f"mtp must be 'auto', 'require' or 'skip', got {mtp!r}")
    has_mtp = any(resolve(n) is not None and resolve(n).path.startswith("mtp.") for n in named)
    include_mtp = mtp == "require" or (mtp == "auto" and has_mtp)
    if mtp == "require" and cfg.num_nextn_predict_layers and not has_mtp:
        raise CheckpointError(
            "missing: every MTP tensor (mtp.0.e_proj.weight, mtp.0.attn.wq_a.weight, ...): the checkpoint has "
            "no MTP weights (transformers' save_pretrained drops them); load with mtp='auto' to run without MTP"
        )
    specs: dict[str, ParamSpec] = flatten_dotted(model_spec(cfg, include_mtp=include_mtp))

    quantized = sorted(n for n in named if n.endswith(".scale") and n[: -len(".scale")] + ".weight" in named)
    if quantized:
        raise CheckpointError(
            "quantized (FP8/FP4) checkpoints are not supported yet; found scale tensors " + ", ".join(quantized[:4])
        )

    whole: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[int, Any]] = {}
    unexpected: list[str] = []
    misshaped: list[str] = []
    for name in named:
        ref = resolve(name)
        if ref is None:
            unexpected.append(f"{name} (not a DeepSeek-V4 weight name)")
            continue
        if ref.path.startswith("mtp.") and not include_mtp:
            continue
        if ref.fused_halves is not None:
            first, second = ref.fused_halves
            if first not in specs:
                unexpected.append(f"{name} (no such layer in this config)")
                continue
            spec = specs[first]
            want = (spec.shape[0], 2 * spec.shape[1], spec.shape[2])
            if tuple(named[name].shape) != want:
                misshaped.append(f"{name}: expected {want}, got {tuple(named[name].shape)}")
                continue
            arr = np.asarray(named[name])
            whole[first], whole[second] = arr[:, : spec.shape[1]], arr[:, spec.shape[1] :]
            continue
        if ref.path not in specs:
            unexpected.append(f"{name} (no {ref.path} in this config: {_why_absent(cfg, ref.path)})")
            continue
        spec = specs[ref.path]
        want = spec.shape[1:] if ref.expert is not None else spec.shape
        if tuple(named[name].shape) != tuple(want):
            misshaped.append(f"{name}: expected {tuple(want)}, got {tuple(named[name].shape)}")
            continue
        if ref.expert is not None:
            if not 0 <= ref.expert < spec.shape[0]:
                unexpected.append(f"{name} (expert {ref.expert} >= n_routed_experts {spec.shape[0]})")
                continue
            per_expert.setdefault(ref.path, {})[ref.expert] = named[name]
        else:
            whole[ref.path] = named[name]

    missing: list[str] = []
    for path, experts in per_expert.items():
        n = specs[path].shape[0]
        absent = [e for e in range(n) if e not in experts]
        if absent:
            missing.extend(official_name(path, e) for e in absent)
        else:
            whole[path] = np.stack([np.asarray(experts[e]) for e in range(n)])
    for path, spec in specs.items():
        if path not in whole and path not in per_expert:
            missing.append(official_name(path, 0) + " (and the other experts)" if ".experts." in path else official_name(path))

    problems = [_listing(k, v) for k, v in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if v]
    if problems:
        raise CheckpointError("checkpoint does not match the config: " + "; ".join(problems))

    values = {}
    for i, (path, spec) in enumerate(specs.items()):
        values[path] = _convert(path, whole[path], spec, dtype, cfg)
        if progress is not None:
            progress(len(specs), i + 1)
    return unflatten_dotted(model_spec(cfg, include_mtp=include_mtp), values)


def _convert(path: str, value: Any, spec: ParamSpec, dtype: Any, cfg: ModelConfig) -> Any:
    arr = np.asarray(value)
    target = spec.resolve_dtype(dtype)
    if jnp.issubdtype(target, jnp.integer):
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"{official_name(path)}: expert ids must lie in [0, {cfg.n_routed_experts})")
        return jnp.asarray(arr.astype(np.int32))
    return jnp.asarray(arr.astype(np.float32) if arr.dtype != target else arr).astype(target)


def _why_absent(cfg: ModelConfig, path: str) -> str:
    parts = path.split(".")
    if parts[0] == "layers" and int(parts[1]) < cfg.num_hidden_layers:
        i = int(parts[1])
        return f"layer {i} is {cfg.layer_types[i]} / {cfg.mlp_layer_types[i]}"
    if parts[0] == "layers":
        return f"num_hidden_layers is {cfg.num_hidden_layers}"
    if parts[0] == "mtp":
        return f"num_nextn_predict_layers is {cfg.num_nextn_predict_layers}"
    if parts[0] == "head":
        return "tie_word_embeddings is set"
    return "unknown tensor"


def load_params(cfg: ModelConfig, directory: str | os.PathLike, dtype: Any = jnp.float32, mtp: str = "auto", progress=None) -> dict:
    """Weights of a safetensors checkpoint directory, checked against ``cfg``."""
    named: dict[str, Any] = {}
    for f in open_checkpoint_files(directory):
        for name in f.keys():
            if name in named:
                raise CheckpointError(f"tensor {name} appears in more than one file")
            named[name] = _LazyTensor(f, name)
    return params_from_named_arrays(cfg, named, dtype=dtype, mtp=mtp, progress=progress)


def load_checkpoint(
    directory: str | os.PathLike, dtype: Any = jnp.float32, mtp: str = "auto", progress=None
) -> tuple[ModelConfig, dict]:
    """(config, params) from a Hugging Face style directory: config.json + safetensors."""
    cfg = ModelConfig.from_json_file(directory)
    return cfg, load_params(cfg, directory, dtype=dtype, mtp=mtp, progress=progress)


class _LazyTensor:
    """A tensor read from its file only when converted (keeps peak host memory low)."""

    def __init__(self, f, name: str):
        self._f, self._name = f, name
        self.shape = f.shape(name)

    def __array__(self, dtype=None, copy=None):
        arr = self._f.get(self._name)
        return arr.astype(dtype) if dtype is not None else arr


def official_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The official release's config.json spelling (compress_ratios, num_hash_layers, rope_scaling)."""
    n_hash = sum(t == HASH_MOE for t in cfg.mlp_layer_types)
    if cfg.mlp_layer_types != tuple([HASH_MOE] * n_hash + [SCORE_MOE] * (cfg.num_hidden_layers - n_hash)):
        raise ValueError("official configs can only express hash layers first (num_hash_layers)")
    ratio = {SLIDING: 0, CSA: cfg.csa_compress_ratio, HCA: cfg.hca_compress_ratio}
    d = cfg.to_hf_dict()
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"):
        d.pop(key)
    d.update(
        compress_ratios=[ratio[t] for t in cfg.layer_types + cfg.mtp_layer_types],
        compress_rate_csa=cfg.csa_compress_ratio,
        compress_rate_hca=cfg.hca_compress_ratio,
        num_hash_layers=n_hash,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
    )
    if cfg.compress_rope.rope_type == "yarn":
        r = cfg.compress_rope
        d["rope_scaling"] = {
            "type": "yarn",
            "factor": r.factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
            "beta_fast": r.beta_fast,
            "beta_slow": r.beta_slow,
        }
    return d


def save_official(cfg: ModelConfig, params: dict, directory: str | os.PathLike) -> None:
    """Write config.json and model.safetensors with the official release's names and spelling."""
    os.makedirs(directory, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, value in flatten_dotted(params).items():
        arr = np.asarray(value)
        if ".ffn.experts." in path:
            for e in range(arr.shape[0]):
                tensors[official_name(path, e)] = arr[e]
        else:
            tensors[official_name(path)] = arr
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(official_config_dict(cfg), f, indent=2)
