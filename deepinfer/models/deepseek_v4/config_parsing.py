"""The two config.json spellings of DeepSeek-V4, parsed into ModelConfig's fields (and written back).

* transformers (>= 5.24): ``layer_types``, ``mlp_layer_types``, ``compress_rates``
  (a dict keyed by layer type), ``partial_rotary_factor`` and a nested
  ``rope_parameters = {"main": {...}, "compress": {...}}``.
* the official release: ``compress_ratios`` (one int per layer, 0 = sliding
  only; may carry one extra entry per MTP layer), ``num_hash_layers``,
  ``qk_rope_head_dim`` and a flat ``rope_scaling`` / ``rope_parameters`` dict.

Absent keys take the transformers defaults (the V4-Flash values), as
``DeepseekV4Config`` does. Keys spelled the same in both and checked alone are
one row each of SCALARS; the rest have a parser of their own below.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from deepinfer.config import (
    ATTENTION_TYPES,
    CSA,
    HASH_MOE,
    HCA,
    MLP_TYPES,
    SCORE_MOE,
    SLIDING,
    ConfigError,
    RopeConfig,
)

# transformers' DeepseekV4Config defaults (V4-Flash), used for absent keys.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1.0e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1.0e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_QK_ROPE_HEAD_DIM_FRACTION = 64 / 512


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(key, f"must be a positive integer, got {value!r}")
    return value


def _non_negative_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, f"must be a non-negative integer, got {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    return float(value)


# ModelConfig fields read from the key of the same name in both spellings, and their check.
SCALARS: dict[str, Callable[[Any, str], Any]] = {
    "vocab_size": _positive_int,
    "hidden_size": _positive_int,
    "num_attention_heads": _positive_int,
    "q_lora_rank": _positive_int,
    "o_groups": _positive_int,
    "o_lora_rank": _positive_int,
    "sliding_window": _positive_int,
    "index_n_heads": _positive_int,
    "index_head_dim": _positive_int,
    "index_topk": _positive_int,
    "n_routed_experts": _positive_int,
    "num_experts_per_tok": _positive_int,
    "n_shared_experts": _non_negative_int,
    "moe_intermediate_size": _positive_int,
    "scoring_func": lambda v, k: v,  # checked against SCORING_FUNCS with the other cross-field checks
    "routed_scaling_factor": _number,
    "swiglu_limit": _number,
    "hc_mult": _positive_int,
    "hc_sinkhorn_iters": _positive_int,
    "hc_eps": _number,
    "rms_norm_eps": _number,
    "max_position_embeddings": _positive_int,
    "tie_word_embeddings": lambda v, k: bool(v),
}


def parse(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json dict (either spelling) -> ModelConfig keyword arguments (not yet cross-checked)."""
    if not isinstance(raw, Mapping):
        raise ConfigError("<root>", f"expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError("model_type", f"expected 'deepseek_v4', got {model_type!r}")

    def get(key: str) -> Any:
        return raw[key] if raw.get(key) is not None else _DEFAULTS[key]

    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError(
            "num_key_value_heads", f"DeepSeek-V4 has one shared latent KV head; got {raw['num_key_value_heads']}"
        )
    n_layers = _positive_int(get("num_hidden_layers"), "num_hidden_layers")
    n_mtp = _non_negative_int(get("num_nextn_predict_layers"), "num_nextn_predict_layers")
    head_dim = _positive_int(get("head_dim"), "head_dim")
    csa_ratio, hca_ratio = _parse_compress_rates(raw)
    layer_types, mtp_types = _parse_layer_types(raw, n_layers, n_mtp, csa_ratio, hca_ratio)
    main_rope, compress_rope = _parse_ropes(raw, get("rope_theta"), get("compress_rope_theta"))
    eos = get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return {
        **{name: check(get(name), name) for name, check in SCALARS.items()},
        "num_hidden_layers": n_layers,
        "head_dim": head_dim,
        "qk_rope_head_dim": _parse_rope_dim(raw, head_dim),
        "layer_types": layer_types,
        "csa_compress_ratio": csa_ratio,
        "hca_compress_ratio": hca_ratio,
        "mlp_layer_types": _parse_mlp_layer_types(raw, n_layers),
        "main_rope": main_rope,
        "compress_rope": compress_rope,
        "num_nextn_predict_layers": n_mtp,
        "mtp_layer_types": mtp_types,
        "bos_token_id": raw.get("bos_token_id", _DEFAULTS["bos_token_id"]),
        "eos_token_ids": tuple(int(e) for e in eos_ids),
    }


def to_hf_dict(cfg) -> dict[str, Any]:
    """The transformers spelling of a ModelConfig (what `DeepseekV4Config(**d)` accepts)."""
    rotary = cfg.qk_rope_head_dim / cfg.head_dim
    compress = {"rope_type": cfg.compress_rope.rope_type, "rope_theta": cfg.compress_rope.theta, "partial_rotary_factor": rotary}
    if cfg.compress_rope.rope_type == "yarn":
        compress.update(
            factor=cfg.compress_rope.factor,
            original_max_position_embeddings=cfg.compress_rope.original_max_position_embeddings,
            beta_fast=cfg.compress_rope.beta_fast,
            beta_slow=cfg.compress_rope.beta_slow,
            attention_factor=cfg.compress_rope.attention_factor,
        )
    return {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        **{name: getattr(cfg, name) for name in SCALARS},
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "partial_rotary_factor": rotary,
        "layer_types": list(cfg.layer_types),
        "compress_rates": {CSA: cfg.csa_compress_ratio, HCA: cfg.hca_compress_ratio},
        "mlp_layer_types": list(cfg.mlp_layer_types),
        "rope_theta": cfg.main_rope.theta,
        "compress_rope_theta": cfg.compress_rope.theta,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": cfg.main_rope.theta, "partial_rotary_factor": rotary},
            "compress": compress,
        },
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
    }


# -- the keys with a parser of their own -----------------------------------------


def _parse_compress_rates(raw: Mapping[str, Any]) -> tuple[int, int]:
    rates = dict(_DEFAULT_COMPRESS_RATES)
    if raw.get("compress_rates") is not None:
        given = raw["compress_rates"]
        if not isinstance(given, Mapping):
            raise ConfigError("compress_rates", f"must be a dict keyed by layer type, got {given!r}")
        unknown = sorted(set(given) - {CSA, HCA})
        if unknown:
            raise ConfigError("compress_rates", f"unknown layer types {unknown}; expected {CSA!r} / {HCA!r}")
        rates.update(given)
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(key) is not None:
            rates[layer_type] = raw[key]
    csa = _positive_int(rates[CSA], f"compress_rates.{CSA}")
    hca = _positive_int(rates[HCA], f"compress_rates.{HCA}")
    if csa == hca:
        raise ConfigError("compress_rates", f"CSA and HCA ratios must differ to tell the layers apart; both are {csa}")
    return csa, hca


def _check_type_list(value: Any, key: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, f"must be a list of strings, got {value!r}")
    bad = [t for t in value if t not in allowed]
    if bad:
        raise ConfigError(key, f"entries must be one of {allowed}; got {bad}")


def _parse_layer_types(
    raw: Mapping[str, Any], n_layers: int, n_mtp: int, csa_ratio: int, hca_ratio: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Main-model and MTP attention types. MTP layers default to sliding-only."""
    explicit = raw.get("layer_types")
    ratios = raw.get("compress_ratios")
    from_ratios = None
    if ratios is not None:
        if not isinstance(ratios, (list, tuple)):
            raise ConfigError("compress_ratios", f"must be a list of ints, got {ratios!r}")
        if len(ratios) not in (n_layers, n_layers + n_mtp):
            raise ConfigError(
                "compress_ratios",
                f"has {len(ratios)} entries; expected num_hidden_layers ({n_layers})"
                + (f" or num_hidden_layers + num_nextn_predict_layers ({n_layers + n_mtp})" if n_mtp else ""),
            )
        by_ratio = {0: SLIDING, csa_ratio: CSA, hca_ratio: HCA}
        bad = [r for r in ratios if r not in by_ratio]
        if bad:
            raise ConfigError(
                "compress_ratios",
                f"entries must be 0 (sliding), {csa_ratio} (CSA) or {hca_ratio} (HCA); got {bad}",
            )
        from_ratios = tuple(by_ratio[r] for r in ratios)
    if explicit is not None:
        _check_type_list(explicit, "layer_types", ATTENTION_TYPES)
        if len(explicit) not in (n_layers, n_layers + n_mtp):
            raise ConfigError(
                "layer_types", f"has {len(explicit)} entries but num_hidden_layers is {n_layers}"
            )
        if from_ratios is not None and tuple(explicit[:n_layers]) != from_ratios[:n_layers]:
            raise ConfigError("layer_types", "disagrees with compress_ratios; give one or make them match")
        types = tuple(explicit)
    elif from_ratios is not None:
        types = from_ratios
    else:
        # transformers' default: 2 HCA layers, then CSA/HCA interleaved.
        types = tuple([HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))])
    main = types[:n_layers]
    mtp = types[n_layers:] if len(types) > n_layers else (SLIDING,) * n_mtp
    return main, tuple(mtp)


def _hash_then_score(n_hash: int, n_layers: int) -> tuple[str, ...]:
    """The official layout: the first num_hash_layers layers hash-routed, the rest score-routed."""
    return tuple([HASH_MOE] * min(n_hash, n_layers) + [SCORE_MOE] * max(0, n_layers - n_hash))


def _parse_mlp_layer_types(raw: Mapping[str, Any], n_layers: int) -> tuple[str, ...]:
    explicit = raw.get("mlp_layer_types")
    n_hash = raw.get("num_hash_layers")
    if explicit is not None:
        _check_type_list(explicit, "mlp_layer_types", MLP_TYPES)
        if len(explicit) != n_layers:
            raise ConfigError(
                "mlp_layer_types", f"has {len(explicit)} entries but num_hidden_layers is {n_layers}"
            )
        types = tuple(explicit)
        if n_hash is not None and types != _hash_then_score(n_hash, n_layers):
            raise ConfigError("num_hash_layers", f"= {n_hash} disagrees with mlp_layer_types")
        return types
    if n_hash is None:
        n_hash = _DEFAULT_NUM_HASH_LAYERS
    n_hash = _non_negative_int(n_hash, "num_hash_layers")
    return _hash_then_score(n_hash, n_layers)


def _parse_rope_dim(raw: Mapping[str, Any], head_dim: int) -> int:
    given_dim = raw.get("qk_rope_head_dim")
    factor = raw.get("partial_rotary_factor")
    if given_dim is not None:
        dim = _positive_int(given_dim, "qk_rope_head_dim")
        if factor is not None and int(head_dim * factor) != dim:
            raise ConfigError(
                "partial_rotary_factor",
                f"{factor} * head_dim ({head_dim}) disagrees with qk_rope_head_dim ({dim})",
            )
    elif factor is not None:
        dim = int(head_dim * _number(factor, "partial_rotary_factor"))
    else:
        dim = int(head_dim * _DEFAULT_QK_ROPE_HEAD_DIM_FRACTION)
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ConfigError(
            "qk_rope_head_dim", f"rope dim must be even and in (0, head_dim={head_dim}]; got {dim}"
        )
    return dim


def _rope_from_dict(d: Mapping[str, Any], theta: float, key: str) -> RopeConfig:
    rope_type = d.get("rope_type", d.get("type", "default"))
    theta = _number(d.get("rope_theta", theta), f"{key}.rope_theta")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"{key}.rope_type", f"only 'default' and 'yarn' are supported; got {rope_type!r}")
    if d.get("original_max_position_embeddings") is None or d.get("factor") is None:
        raise ConfigError(key, "yarn needs 'factor' and 'original_max_position_embeddings'")
    if d.get("mscale") or d.get("mscale_all_dim"):
        raise ConfigError(key, "yarn mscale / mscale_all_dim are not used by DeepSeek-V4 and not supported")
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=_number(d["factor"], f"{key}.factor"),
        original_max_position_embeddings=_positive_int(
            d["original_max_position_embeddings"], f"{key}.original_max_position_embeddings"
        ),
        beta_fast=_number(d.get("beta_fast") or 32, f"{key}.beta_fast"),
        beta_slow=_number(d.get("beta_slow") or 1, f"{key}.beta_slow"),
        # V4's reference does not rescale cos/sin: attention_factor defaults to 1.
        attention_factor=_number(d.get("attention_factor", 1.0), f"{key}.attention_factor"),
    )


def _parse_ropes(raw: Mapping[str, Any], rope_theta: Any, compress_theta: Any) -> tuple[RopeConfig, RopeConfig]:
    """Sliding layers use plain rope at rope_theta; CSA/HCA use compress_rope_theta, maybe YaRN."""
    rope_theta = _number(rope_theta, "rope_theta")
    compress_theta = _number(compress_theta, "compress_rope_theta")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, Mapping):
        raise ConfigError(key, f"must be a dict, got {params!r}")
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main = _rope_from_dict(params["main"], rope_theta, f"{key}.main")
        compress = _rope_from_dict(params["compress"], compress_theta, f"{key}.compress")
        if main.rope_type != "default":
            raise ConfigError(f"{key}.main.rope_type", "sliding layers use plain rope in DeepSeek-V4")
        return main, compress
    # Flat form: the scaling applies to the compressed layers only.
    flat = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return RopeConfig(theta=rope_theta), _rope_from_dict(flat, compress_theta, key)
