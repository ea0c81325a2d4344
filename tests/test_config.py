"""ModelConfig: both spellings, hashable, and errors that name the key."""

import jax
import jax.numpy as jnp
import pytest

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.models.deepseek_v4.loader import official_config_dict
from tests.reference import TINY_CONFIGS, deepinfer_config, hf_config

OFFICIAL_FLASH_LIKE = {
    # the official release's spelling (values shrunk)
    "model_type": "deepseek_v4",
    "vocab_size": 100,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "compress_ratios": [0, 0, 4, 128, 4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "num_nextn_predict_layers": 1,
}


def test_official_and_transformers_spellings_agree():
    official = ModelConfig.from_dict(OFFICIAL_FLASH_LIKE)
    assert official.layer_types == (
        "sliding_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    )
    assert official.mtp_layer_types == ("sliding_attention",)
    assert official.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe")
    assert official.qk_rope_head_dim == 8
    assert official.compress_rope.rope_type == "yarn" and official.compress_rope.attention_factor == 1.0
    assert official.main_rope.rope_type == "default"

    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(**OFFICIAL_FLASH_LIKE)  # transformers folds the legacy keys itself
    assert ModelConfig.from_dict(hf.to_dict()) == official


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_roundtrips(name):
    cfg = deepinfer_config(name)
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
    assert ModelConfig.from_dict(official_config_dict(cfg)) == cfg
    assert ModelConfig.from_dict(hf_config(name).to_dict()) == cfg


def test_hashable_and_static_under_jit():
    cfg = deepinfer_config("mixed")
    assert hash(cfg) == hash(deepinfer_config("mixed"))
    traces = []


    def g(c, x):
        traces.append(1)
        return x * c.hidden_size

    gj = jax.jit(g, static_argnums=0)
    gj(cfg, jnp.ones(2))
    gj(deepinfer_config("mixed"), jnp.ones(2))
    assert len(traces) == 1  # equal configs hit the same compiled program


@pytest.mark.parametrize(
    "change, key, text",
    [
        ({"model_type": "llama"}, "model_type", "expected 'deepseek_v4'"),
        ({"hidden_size": 0}, "hidden_size", "positive integer"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers", "positive integer"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types", "has 3 entries but num_hidden_layers is 4"),
        ({"layer_types": ["sliding_attention", "full", "x", "y"]}, "layer_types", "entries must be one of"),
        ({"mlp_layer_types": ["moe"] * 5}, "mlp_layer_types", "has 5 entries"),
        ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types", "entries must be one of"),
        ({"compress_ratios": [0, 4, 8, 3]}, "compress_ratios", "entries must be 0 (sliding), 4 (CSA) or 8 (HCA); got [3]"),
        ({"compress_ratios": [0, 8, 8, 4]}, "layer_types", "disagrees with compress_ratios"),
        ({"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 8}}, "compress_rates", "must differ"),
        ({"num_key_value_heads": 4}, "num_key_value_heads", "one shared latent KV head"),
        ({"o_groups": 3}, "o_groups", "not divisible by o_groups (3)"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok", "exceeds n_routed_experts (6)"),
        ({"scoring_func": "softmax"}, "scoring_func", "must be one of"),
        ({"qk_rope_head_dim": 7, "partial_rotary_factor": None}, "qk_rope_head_dim", "must be even"),
        ({"qk_rope_head_dim": 4}, "partial_rotary_factor", "disagrees with qk_rope_head_dim"),
        ({"index_head_dim": 6}, "index_head_dim", "at least qk_rope_head_dim (8)"),
        ({"eos_token_id": 500}, "eos_token_id", "outside the vocabulary (size 96)"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_parameters.rope_type", "only 'default' and 'yarn'"),
        ({"num_hash_layers": 1}, "num_hash_layers", "disagrees with mlp_layer_types"),
    ],
)
def test_invalid_configs_name_the_key(change, key, text):
    raw = dict(TINY_CONFIGS["mixed"])
    raw.update(change)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    assert info.value.key == key
    assert str(info.value).startswith(f"config key '{key}': ")
    assert text in str(info.value)


def test_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ModelConfig.from_json_file(tmp_path)
