"""Load DeepSeek-V4 weights from safetensors (transformers or official naming); write official-style.

Every problem is collected and reported at once, naming the tensors: missing
(by official name), unexpected (by on-disk name, with the reason), mis-shaped
(both shapes), badly quantized (a scale that does not fit its weight). The
release's FP8 / FP4 weights load dequantized or kept quantized
(deepinfer/quant/). Parameters are placed one at a time (deepinfer/weight_placement.py),
so the host never holds the whole model.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer.config import CSA, HASH_MOE, HCA, SCORE_MOE, SLIDING, ModelConfig
from deepinfer.models.deepseek_v4.param_tree import model_spec
from deepinfer.models.deepseek_v4.weight_names import official_name, resolve
from deepinfer.params import ParamSpec, flatten_dotted, unflatten_dotted
from deepinfer.quant.checkpoint import pair_scales, stored_format
from deepinfer.quant.formats import is_quantized
from deepinfer.safetensors_io import (
    SafetensorsError,
    checkpoint_tensors,
    save_file,
    save_sharded,
)
from deepinfer.weight_placement import Source, place_weight

_MAX_LISTED = 12


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; the message names the tensors."""


def _listing(kind: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{kind} ({len(items)}): {shown}{more}"


def params_from_named_arrays(
    cfg: ModelConfig,
    named: Mapping[str, Any],
    dtype: Any = jnp.float32,
    mtp: str = "auto",
    progress=None,
    quantized_weights: str = "dequantize",
    shardings: Mapping[str, Any] | None = None,
    fp8_block: tuple[int, int] = (128, 128),
) -> dict:
    """Build the parameter tree from ``{checkpoint name: array-like}``.

    ``named`` values only need ``.shape``, ``.dtype`` and ``np.asarray``-ability, and are
    read lazily, one parameter at a time. ``progress``, when given, is told the totals
    (``progress.start(tensors, bytes)``) and each placed parameter (``progress.advance(tensors, bytes)``).
    ``mtp``: "auto" loads MTP blocks when the checkpoint has them, "require" fails without
    them, "skip" ignores them. Quantized (FP8 / FP4) weights are dequantized to ``dtype``
    (``quantized_weights="dequantize"``) or kept in their stored format (``"keep"``, see
    deepinfer/quant/formats.py). ``shardings``: ``{tree path: Sharding}`` to place each
    parameter into (streamed per device shard); absent paths go to the default device.
    Every problem is found before any tensor is read.
    """
    if mtp not in ("auto", "require", "skip"):
        raise ValueError(f"mtp must be 'auto', 'require' or 'skip', got {mtp!r}")
    if quantized_weights not in ("dequantize", "keep"):
        raise ValueError(f"quantized_weights must be 'dequantize' or 'keep', got {quantized_weights!r}")
    weights, scales, unexpected = pair_scales(named)
    has_mtp = any(resolve(n) is not None and resolve(n).path.startswith("mtp.") for n in weights)
    include_mtp = mtp == "require" or (mtp == "auto" and has_mtp)
    if mtp == "require" and cfg.num_nextn_predict_layers and not has_mtp:
        raise CheckpointError(
            "missing: every MTP tensor (mtp.0.e_proj.weight, mtp.0.attn.wq_a.weight, ...): the checkpoint has "
            "no MTP weights (transformers' save_pretrained drops them); load with mtp='auto' to run without MTP"
        )
    specs: dict[str, ParamSpec] = flatten_dotted(model_spec(cfg, include_mtp=include_mtp))

    whole: dict[str, Source] = {}
    per_expert: dict[str, dict[int, Source]] = {}
    misshaped: list[str] = []
    badly_quantized: list[str] = []
    reported: set[str] = set()
    for name, tensor in weights.items():
        ref = resolve(name)
        if ref is None:
            unexpected.append(f"{name} (not a DeepSeek-V4 weight name)")
            continue
        if ref.path.startswith("mtp.") and not include_mtp:
            continue
        fmt = stored_format(name, tensor, scales.get(name), fp8_block)
        if isinstance(fmt, str):
            badly_quantized.append(fmt)
            reported.add(ref.path)  # not also "missing"
            continue
        shape = fmt.shape if fmt is not None else tuple(tensor.shape)
        if ref.fused_halves is not None:
            first, second = ref.fused_halves
            if first not in specs:
                unexpected.append(f"{name} (no such layer in this config)")
                continue
            spec = specs[first]
            want = (spec.shape[0], 2 * spec.shape[1], spec.shape[2])
            if shape != want:
                misshaped.append(f"{name}: expected {want}, got {shape}")
            elif fmt is not None:
                badly_quantized.append(f"{name}: a quantized fused gate_up tensor (store w1 / w3 per expert)")
            else:
                arr = np.asarray(tensor)
                whole[first] = Source(name, arr[:, : spec.shape[1]])
                whole[second] = Source(name, arr[:, spec.shape[1] :])
            continue
        if ref.path not in specs:
            unexpected.append(f"{name} (no {ref.path} in this config: {_why_absent(cfg, ref.path)})")
            continue
        spec = specs[ref.path]
        want = spec.shape[1:] if ref.expert is not None else spec.shape
        if shape != tuple(want):
            misshaped.append(f"{name}: expected {tuple(want)}, got {shape}")
            continue
        if fmt is not None and jnp.issubdtype(spec.resolve_dtype(dtype), jnp.integer):
            badly_quantized.append(f"{name}: an integer table cannot be quantized")
            continue
        src = Source(name, tensor, scales.get(name), fmt)
        if ref.expert is not None:
            if not 0 <= ref.expert < spec.shape[0]:
                unexpected.append(f"{name} (expert {ref.expert} >= n_routed_experts {spec.shape[0]})")
                continue
            per_expert.setdefault(ref.path, {})[ref.expert] = src
        else:
            whole[ref.path] = src

    missing: list[str] = []
    stacked: dict[str, list[Source]] = {}
    for path, experts in per_expert.items():
        n = specs[path].shape[0]
        absent = [e for e in range(n) if e not in experts]
        if absent and path not in reported:
            missing.extend(official_name(path, e) for e in absent)
        if absent:
            continue
        parts = [experts[e] for e in range(n)]
        layouts = [(p.fmt, None if p.scale is None else (np.dtype(p.scale.dtype), tuple(p.scale.shape))) for p in parts]
        odd = next((e for e, layout in enumerate(layouts) if layout != layouts[0]), None)
        if odd is not None:
            badly_quantized.append(f"{official_name(path, odd)}: stored unlike expert 0 of its layer (one layer's "
                                   "experts share one format, block and scale dtype)")
        stacked[path] = parts
    for path, spec in specs.items():
        if path not in whole and path not in per_expert and path not in reported:
            missing.append(official_name(path, 0) + " (and the other experts)" if ".experts." in path else official_name(path))

    kinds = (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped), ("badly quantized", badly_quantized))
    problems = [_listing(k, v) for k, v in kinds if v]
    if problems:
        raise CheckpointError("checkpoint does not match the config: " + "; ".join(problems))

    sources = {path: stacked.get(path, whole.get(path)) for path in specs}
    if progress is not None:
        progress.start(len(specs), sum(_source_bytes(s) for s in sources.values()))
    values = {}
    for path, spec in specs.items():
        values[path] = _convert(path, sources[path], spec, dtype, cfg, quantized_weights == "keep", (shardings or {}).get(path))
        if progress is not None:
            progress.advance(1, _source_bytes(sources[path]))
    return unflatten_dotted(model_spec(cfg, include_mtp=include_mtp), values)


def _source_bytes(source: Source | list[Source]) -> int:
    return source.nbytes if isinstance(source, Source) else sum(p.nbytes for p in source)


def _convert(path: str, source: Source | list[Source], spec: ParamSpec, dtype: Any, cfg: ModelConfig, keep: bool, sharding) -> Any:
    target = spec.resolve_dtype(dtype)
    if jnp.issubdtype(target, jnp.integer):
        arr = np.asarray(source.tensor)
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"{official_name(path)}: expert ids must lie in [0, {cfg.n_routed_experts})")
        source = Source(source.name, arr.astype(np.int32))
    try:
        return place_weight(source, spec.shape, target, keep_quantized=keep, sharding=sharding)
    except ValueError as e:  # a corrupt scale, named
        raise CheckpointError(str(e)) from None


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


def load_params(
    cfg: ModelConfig,
    directory: str | os.PathLike,
    dtype: Any = jnp.float32,
    mtp: str = "auto",
    progress=None,
    quantized_weights: str = "dequantize",
    shardings: Mapping[str, Any] | None = None,
) -> dict:
    """Weights of a safetensors checkpoint directory (one file or shards with an index), checked against ``cfg``."""
    try:
        files = checkpoint_tensors(directory)
        named = {name: _LazyTensor(f, name) for name, f in files.items()}
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    return params_from_named_arrays(
        cfg, named, dtype=dtype, mtp=mtp, progress=progress, quantized_weights=quantized_weights,
        shardings=shardings, fp8_block=fp8_block_size(directory),
    )


def fp8_block_size(directory: str | os.PathLike) -> tuple[int, int]:
    """The FP8 scale block of a checkpoint: its config's ``quantization_config.weight_block_size`` (128x128 default)."""
    path = os.path.join(os.fspath(directory), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            block = (json.load(f).get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    except (OSError, json.JSONDecodeError):
        return (128, 128)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{path}: quantization_config.weight_block_size must be two positive integers, got {block}")
    return (block[0], block[1])


def load_checkpoint(
    directory: str | os.PathLike,
    dtype: Any = jnp.float32,
    mtp: str = "auto",
    progress=None,
    quantized_weights: str = "dequantize",
    shardings: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, dict]:
    """(config, params) from a Hugging Face style directory: config.json + safetensors."""
    cfg = ModelConfig.from_json_file(directory)
    params = load_params(
        cfg, directory, dtype=dtype, mtp=mtp, progress=progress, quantized_weights=quantized_weights, shardings=shardings
    )
    return cfg, params


class _LazyTensor:
    """A tensor read from its file only when converted (keeps peak host memory low)."""

    def __init__(self, f, name: str):
        self._f, self._name = f, name
        self.shape = f.shape(name)
        self.dtype = f.dtype(name)  # an unknown dtype is refused here, before anything is read
        self.nbytes = f.nbytes(name)

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


def save_official(
    cfg: ModelConfig, params: dict, directory: str | os.PathLike, max_shard_bytes: int | None = None, quantization: dict | None = None
) -> None:
    """Write config.json and the weights with the official release's names and spelling.

    Weights kept quantized (QuantizedArray) are written back as the release stores
    them: the bytes under ``.weight`` (FP4 as int8) and the scale under ``.scale``.
    ``max_shard_bytes`` splits the tensors into shards with an index.
    ``quantization``: the ``quantization_config`` to record (taken from the weights when None).
    """
    os.makedirs(directory, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    blocks = set()

    def put(name: str, value: Any) -> None:
        if not is_quantized(value):
            tensors[name] = np.asarray(value)
            return
        data, scale = np.asarray(value.data), np.asarray(value.scale)
        tensors[name] = data.view(np.int8) if data.dtype == np.uint8 else data
        tensors[name[: -len(".weight")] + ".scale"] = scale.view(ml_dtypes.float8_e8m0fnu) if scale.dtype == np.uint8 else scale
        if value.kind == "fp8_block":
            blocks.add((value.block, scale.dtype == np.uint8))

    for path, value in flatten_dotted(params).items():
        if ".ffn.experts." in path:
            for e in range(value.shape[0]):
                put(official_name(path, e), value[e] if is_quantized(value) else np.asarray(value)[e])
        else:
            put(official_name(path), value)
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
    else:
        save_sharded(tensors, directory, max_shard_bytes)
    config = official_config_dict(cfg)
    if quantization is None and blocks:
        (block, ue8m0), *rest = sorted(blocks)
        if rest:
            raise ValueError(f"FP8 weights with different blocks or scale formats cannot share one config: {sorted(blocks)}")
        quantization = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "scale_fmt": "ue8m0" if ue8m0 else "float", "weight_block_size": list(block)}
    if quantization is not None:
        config["quantization_config"] = quantization
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
