"""The bundled model's architecture: every V4 layer type at toy widths.

Layers: sliding, CSA (ratio 4, indexer top-16), HCA (ratio 16), CSA; the first layer
hash-routed, the rest score-routed; 8 experts (top 2) + a shared expert; 4
hyper-connection streams; one MTP block (sliding). HCA's ratio is 16 rather than
V4's 128 so that training rows of 256 tokens see several of its compressed rows.
"""

from __future__ import annotations


def model_config(vocab_size: int, hidden: int = 256, moe_intermediate: int = 128, max_len: int = 4096) -> dict:
    rope_main = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    return {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 96,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 16,
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": moe_intermediate,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": rope_main,
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "factor": 16.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
                         "attention_factor": 1.0},
        },
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": max_len,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
