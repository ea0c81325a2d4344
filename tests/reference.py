"""The transformers reference for tests: tiny configs, randomised torch models, conversion.

transformers initialises several parameters to zero or identity (tid2eid, the
score-correction bias, sinks, compressor positional bias, hc bases and scales,
norms); a comparison with those left alone proves nothing about them, so
:func:`randomize_` gives every tensor random values first.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.loader import params_from_named_arrays

# Three tiny configs (configs/tiny_*.json, transformers spelling) that together
# cover: sliding / CSA / HCA layers, hash and score MoE, more visible compressed rows
# than index_topk, prompts shorter than the window and prompts spanning many
# compressed rows (ratios lowered), YaRN and plain rope, sqrtsoftplus and sigmoid
# routing, hc_mult 4 and 2.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
TINY_CONFIGS: dict[str, dict] = {
    name: json.load(open(os.path.join(CONFIG_DIR, f"tiny_{name}.json"), encoding="utf-8"))
    for name in ("mixed", "dense_compression", "short_prompt")
}

# (batch, sequence length) per config: lengths not a multiple of the ratios.
TINY_SHAPES = {"mixed": (2, 45), "dense_compression": (1, 37), "short_prompt": (3, 9)}


def hf_config(name: str):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**copy.deepcopy(TINY_CONFIGS[name]), attn_implementation="eager")


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


@dataclass(frozen=True)
class Case:
    """One tiny reference setup: the torch model, our config and params, tokens."""

    name: str
    model: object
    cfg: ModelConfig
    params: dict
    tokens: np.ndarray


@functools.lru_cache(maxsize=None)
def load_case(name: str, seed: int = 0) -> Case:
    """Cached per test session: building and converting is the slow part. Treat as read-only."""
    model = build_reference(name, seed)
    cfg = deepinfer_config(name)
    return Case(name, model, cfg, params_from_torch(cfg, model), random_tokens(name))
