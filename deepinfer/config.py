"""ModelConfig: the DeepSeek-V4 architecture, parsed from a Hugging Face config.json.

Two spellings exist on disk and both are accepted:

* transformers (>= 5.24): ``layer_types``, ``mlp_layer_types``, ``compress_rates``
  (a dict keyed by layer type), ``partial_rotary_factor`` and a nested
  ``rope_parameters = {"main": {...}, "compress": {...}}``.
* the official release: ``compress_ratios`` (one int per layer, 0 = sliding
  only; may carry one extra entry per MTP layer), ``num_hash_layers``,
  ``qk_rope_head_dim`` and a flat ``rope_scaling`` / ``rope_parameters`` dict.

Absent keys take the transformers defaults (the V4-Flash values), as
``DeepseekV4Config`` does. The result is frozen and hashable so it can be a
static argument of ``jax.jit``. Anything invalid or inconsistent raises
:class:`ConfigError` naming the key and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)

HASH_MOE = "hash_moe"
SCORE_MOE = "moe"
MLP_TYPES = (HASH_MOE, SCORE_MOE)

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")

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


class ConfigError(ValueError):
    """A config.json that cannot describe a DeepSeek-V4 model; the message names the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"config key '{key}': {problem}")
        self.key = key


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one rope type ("main" for sliding layers, "compress" for CSA/HCA).

    ``rope_type`` is "default" or "yarn". For YaRN the reference forces
    ``attention_factor = 1.0`` unless the config sets it (no mscale on cos/sin).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Frozen DeepSeek-V4 architecture. Shapes below use these names.

    D = hidden_size, H = num_attention_heads, hd = head_dim, rd = qk_rope_head_dim,
    E = n_routed_experts, I = moe_intermediate_size, hc = hc_mult.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_compress_ratio: int
    hca_compress_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    num_nextn_predict_layers: int
    mtp_layer_types: tuple[str, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    # Not an architecture fact but a numerics mode (static, so it lives here): compute every
    # token's result in an order that does not depend on the rest of the batch. Set by the
    # engine (EngineConfig.batch_invariant / DEEPINFER_BATCH_INVARIANT=1); never read from JSON.
    batch_invariant: bool = False

    # -- derived facts -----------------------------------------------------

    def compress_ratio(self, layer_type: str) -> int:
        """Tokens per compressed row for a layer type (0 for sliding-only layers)."""
        return {SLIDING: 0, CSA: self.csa_compress_ratio, HCA: self.hca_compress_ratio}[layer_type]

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with fields changed, validated again."""
        new = dataclasses.replace(self, **changes)
        _validate(new)
        return new

    # -- construction ------------------------------------------------------

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read a config.json file, or the config.json inside a checkpoint directory."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError("<file>", f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        """Parse a config.json dict in either the transformers or the official spelling."""
        if not isinstance(raw, Mapping):
            raise ConfigError("<root>", f"expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ConfigError("model_type", f"expected 'deepseek_v4', got {model_type!r}")

        def get(key: str) -> Any:
            return raw[key] if raw.get(key) is not None else _DEFAULTS[key]

        n_layers = _positive_int(get("num_hidden_layers"), "num_hidden_layers")
        n_mtp = _non_negative_int(get("num_nextn_predict_layers"), "num_nextn_predict_layers")
        head_dim = _positive_int(get("head_dim"), "head_dim")
        csa_ratio, hca_ratio = _parse_compress_rates(raw)
        layer_types, mtp_types = _parse_layer_types(raw, n_layers, n_mtp, csa_ratio, hca_ratio)
        mlp_types = _parse_mlp_layer_types(raw, n_layers)
        rope_dim = _parse_rope_dim(raw, head_dim)
        main_rope, compress_rope = _parse_ropes(raw, get("rope_theta"), get("compress_rope_theta"))

        eos = get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if raw.get("num_key_value_heads", 1) != 1:
            raise ConfigError(
                "num_key_value_heads",
                f"DeepSeek-V4 has one shared latent KV head; got {raw['num_key_value_heads']}",
            )

        cfg = cls(
            vocab_size=_positive_int(get("vocab_size"), "vocab_size"),
            hidden_size=_positive_int(get("hidden_size"), "hidden_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=_positive_int(get("num_attention_heads"), "num_attention_heads"),
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=_positive_int(get("q_lora_rank"), "q_lora_rank"),
            o_groups=_positive_int(get("o_groups"), "o_groups"),
            o_lora_rank=_positive_int(get("o_lora_rank"), "o_lora_rank"),
            sliding_window=_positive_int(get("sliding_window"), "sliding_window"),
            layer_types=layer_types,
            csa_compress_ratio=csa_ratio,
            hca_compress_ratio=hca_ratio,
            index_n_heads=_positive_int(get("index_n_heads"), "index_n_heads"),
            index_head_dim=_positive_int(get("index_head_dim"), "index_head_dim"),
            index_topk=_positive_int(get("index_topk"), "index_topk"),
            mlp_layer_types=mlp_types,
            n_routed_experts=_positive_int(get("n_routed_experts"), "n_routed_experts"),
            num_experts_per_tok=_positive_int(get("num_experts_per_tok"), "num_experts_per_tok"),
            n_shared_experts=_non_negative_int(get("n_shared_experts"), "n_shared_experts"),
            moe_intermediate_size=_positive_int(get("moe_intermediate_size"), "moe_intermediate_size"),
            scoring_func=get("scoring_func"),
            routed_scaling_factor=_number(get("routed_scaling_factor"), "routed_scaling_factor"),
            swiglu_limit=_number(get("swiglu_limit"), "swiglu_limit"),
            hc_mult=_positive_int(get("hc_mult"), "hc_mult"),
            hc_sinkhorn_iters=_positive_int(get("hc_sinkhorn_iters"), "hc_sinkhorn_iters"),
            hc_eps=_number(get("hc_eps"), "hc_eps"),
            rms_norm_eps=_number(get("rms_norm_eps"), "rms_norm_eps"),
            main_rope=main_rope,
            compress_rope=compress_rope,
            num_nextn_predict_layers=n_mtp,
            mtp_layer_types=mtp_types,
            max_position_embeddings=_positive_int(get("max_position_embeddings"), "max_position_embeddings"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            bos_token_id=raw.get("bos_token_id", _DEFAULTS["bos_token_id"]),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
        _validate(cfg)
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers spelling of this config (what `DeepseekV4Config(**d)` accepts)."""
        compress = {
            "rope_type": self.compress_rope.rope_type,
            "rope_theta": self.compress_rope.theta,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
        }
        if self.compress_rope.rope_type == "yarn":
            compress.update(
                factor=self.compress_rope.factor,
                original_max_position_embeddings=self.compress_rope.original_max_position_embeddings,
                beta_fast=self.compress_rope.beta_fast,
                beta_slow=self.compress_rope.beta_slow,
                attention_factor=self.compress_rope.attention_factor,
            )
        return {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "compress_rates": {CSA: self.csa_compress_ratio, HCA: self.hca_compress_ratio},
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "mlp_layer_types": list(self.mlp_layer_types),
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.main_rope.theta,
            "compress_rope_theta": self.compress_rope.theta,
            "rope_parameters": {
                "main": {
                    "rope_type": "default",
                    "rope_theta": self.main_rope.theta,
                    "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
                },
                "compress": compress,
            },
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }


# -- parsing helpers -----------------------------------------------------------


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
        if not isinstance(explicit, (list, tuple)):
            raise ConfigError("layer_types", f"must be a list of strings, got {explicit!r}")
        bad = [t for t in explicit if t not in ATTENTION_TYPES]
        if bad:
            raise ConfigError("layer_types", f"entries must be one of {ATTENTION_TYPES}; got {bad}")
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


def _parse_mlp_layer_types(raw: Mapping[str, Any], n_layers: int) -> tuple[str, ...]:
    explicit = raw.get("mlp_layer_types")
    n_hash = raw.get("num_hash_layers")
    if explicit is not None:
        if not isinstance(explicit, (list, tuple)):
            raise ConfigError("mlp_layer_types", f"must be a list of strings, got {explicit!r}")
        bad = [t for t in explicit if t not in MLP_TYPES]
        if bad:
            raise ConfigError("mlp_layer_types", f"entries must be one of {MLP_TYPES}; got {bad}")
        if len(explicit) != n_layers:
            raise ConfigError(
                "mlp_layer_types", f"has {len(explicit)} entries but num_hidden_layers is {n_layers}"
            )
        types = tuple(explicit)
        if n_hash is not None and types != tuple([HASH_MOE] * min(n_hash, n_layers) + [SCORE_MOE] * max(0, n_layers - n_hash)):
            raise ConfigError("num_hash_layers", f"= {n_hash} disagrees with mlp_layer_types")
        return types
    if n_hash is None:
        n_hash = _DEFAULT_NUM_HASH_LAYERS
    n_hash = _non_negative_int(n_hash, "num_hash_layers")
    return tuple([HASH_MOE] * min(n_hash, n_layers) + [SCORE_MOE] * max(0, n_layers - n_hash))


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


def _validate(cfg: ModelConfig) -> None:
    """Cross-field checks on a parsed config."""
    if cfg.num_attention_heads * cfg.head_dim % cfg.o_groups:
        raise ConfigError(
            "o_groups",
            f"num_attention_heads * head_dim ({cfg.num_attention_heads * cfg.head_dim}) "
            f"is not divisible by o_groups ({cfg.o_groups})",
        )
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(
            "o_groups", f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by o_groups ({cfg.o_groups})"
        )
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(
            "num_experts_per_tok",
            f"{cfg.num_experts_per_tok} exceeds n_routed_experts ({cfg.n_routed_experts})",
        )
    if cfg.scoring_func not in SCORING_FUNCS:
        raise ConfigError("scoring_func", f"must be one of {SCORING_FUNCS}; got {cfg.scoring_func!r}")
    if cfg.index_head_dim < cfg.qk_rope_head_dim or cfg.index_head_dim % 2:
        raise ConfigError(
            "index_head_dim",
            f"must be even and at least qk_rope_head_dim ({cfg.qk_rope_head_dim}); got {cfg.index_head_dim}",
        )
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError("layer_types", f"has {len(cfg.layer_types)} entries but num_hidden_layers is {cfg.num_hidden_layers}")
    if len(cfg.mlp_layer_types) != cfg.num_hidden_layers:
        raise ConfigError(
            "mlp_layer_types", f"has {len(cfg.mlp_layer_types)} entries but num_hidden_layers is {cfg.num_hidden_layers}"
        )
    if len(cfg.mtp_layer_types) != cfg.num_nextn_predict_layers:
        raise ConfigError("num_nextn_predict_layers", "does not match the number of MTP layer types")
    for eos in cfg.eos_token_ids:
        if not 0 <= eos < cfg.vocab_size:
            raise ConfigError("eos_token_id", f"{eos} is outside the vocabulary (size {cfg.vocab_size})")
