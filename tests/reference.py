"""The transformers reference for tests: tiny configs, randomised torch models, conversion.

transformers initialises several parameters to zero or identity (tid2eid, the
score-correction bias, sinks, compressor positional bias, hc bases and scales,
norms); a comparison with those left alone proves nothing about them, so
:func:`randomize_` gives every tensor random values first.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.loader import params_from_named_arrays

# Three tiny configs that together cover: sliding / CSA / HCA layers, hash and score
# MoE, more visible compressed rows than index_topk, prompts shorter than the window
# and prompts spanning many compressed rows (ratios lowered), YaRN and plain rope,
# sqrtsoftplus and sigmoid routing, hc_mult 4 and 2.
TINY_CONFIGS: dict[str, dict] = {
    "mixed": dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        q_lora_rank=24,
        o_groups=2,
        o_lora_rank=12,
        sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        index_n_heads=8,
        index_head_dim=12,
        index_topk=3,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        hc_mult=4,
        num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=128,
    ),
    "dense_compression": dict(
        vocab_size=80,
        hidden_size=24,
        num_hidden_layers=3,
        num_attention_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        q_lora_rank=16,
        o_groups=1,
        o_lora_rank=16,
        sliding_window=4,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        index_n_heads=8,
        index_head_dim=8,
        index_topk=2,
        n_routed_experts=4,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        hc_mult=2,
        scoring_func="sigmoid",
        num_nextn_predict_layers=1,
        max_position_embeddings=256,
    ),
    "short_prompt": dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=8,
        partial_rotary_factor=0.5,
        q_lora_rank=16,
        o_groups=4,
        o_lora_rank=8,
        sliding_window=16,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["moe", "moe", "moe"],
        index_n_heads=8,
        index_head_dim=8,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        hc_mult=4,
        num_nextn_predict_layers=1,
        max_position_embeddings=128,
    ),
}

# (batch, sequence length) per config: lengths not a multiple of the ratios.
TINY_SHAPES = {"mixed": (2, 45), "dense_compression": (1, 37), "short_prompt": (3, 9)}


def hf_config(name: str):
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(**copy.deepcopy(TINY_CONFIGS[name]), attn_implementation="eager")
    return cfg


def deepinfer_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(hf_config(name).to_dict())


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter and buffer a random value of a sensible scale, in place."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        if name.endswith("tid2eid"):
            rows = torch.rand(t.shape[0], cfg.n_routed_experts, generator=gen).argsort(dim=-1)
            t.copy_(rows[:, : t.shape[1]])
        elif t.ndim >= 2 and not name.endswith("position_bias"):
            fan_in = t.shape[-1]
            t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(fan_in))
        elif name.endswith("position_bias"):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.7)
        elif "norm" in name:
            t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
        elif name.endswith("scale") or name.endswith("hc_scale"):
            t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
        else:  # sinks, hc bases, score-correction bias
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)


def build_reference(name: str, seed: int = 0):
    """A randomised transformers DeepseekV4ForCausalLM (fp32, eager) for a tiny config."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config(name)).eval()
    randomize_(model, seed)
    return model


def params_from_torch(cfg: ModelConfig, model: torch.nn.Module, dtype=np.float32, mtp: str = "skip") -> dict:
    """Our parameter tree from the torch model's in-memory names (exercises the name mapping)."""
    named = {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy() for k, v in model.state_dict().items()}
    return params_from_named_arrays(cfg, named, dtype=dtype, mtp=mtp)


def random_tokens(name: str, seed: int = 1) -> np.ndarray:
    b, s = TINY_SHAPES[name]
    vocab = TINY_CONFIGS[name]["vocab_size"]
    return np.random.default_rng(seed).integers(0, vocab, size=(b, s))


@torch.no_grad()
def reference_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    out = model(input_ids=torch.as_tensor(tokens), use_cache=False)
    return out.logits.float().numpy()
