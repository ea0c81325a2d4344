"""ModelConfig: the DeepSeek-V4 architecture, parsed from a Hugging Face config.json.

Both on-disk spellings (transformers and the official release) are parsed in the
model's package (models/deepseek_v4/config_parsing.py). The result is frozen and
hashable so it can be a static argument of ``jax.jit``. Anything invalid or
inconsistent raises :class:`ConfigError` naming the key and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from pallas_kernels.selection import KernelChoice

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)

HASH_MOE = "hash_moe"
SCORE_MOE = "moe"
MLP_TYPES = (HASH_MOE, SCORE_MOE)

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")

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
    # Which implementation each kernel op runs (Pallas kernel or pure-JAX reference; pallas_kernels/
    # selection.py), static for the same reason; set by the engine from the platform and DEEPINFER_KERNELS.
    kernels: KernelChoice = KernelChoice()
    # The mesh and placement rules of a multi-device engine (sharding/plan.py ShardingPlan), static
    # for the same reason; set by the engine from its parallel layout. None: one device.
    sharding: Any = None

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
        """Parse a config.json dict in either the transformers or the official spelling
        (models/deepseek_v4/config_parsing.py has the table of keys)."""
        from deepinfer.models.deepseek_v4.config_parsing import parse

        cfg = cls(**parse(raw))
        _validate(cfg)
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers spelling of this config (what `DeepseekV4Config(**d)` accepts)."""
        from deepinfer.models.deepseek_v4.config_parsing import to_hf_dict

        return to_hf_dict(self)


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
