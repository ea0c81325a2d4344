"""The DeepSeek-V4 parameter tree, described once (see deepinfer/params.py).

Keys follow the official release's short names (``wq_a``, ``wkv``, ``ffn.experts.w1``
...); ``weight_names.py`` maps the on-disk spellings to these paths. Matrices keep
the checkpoint's ``[out, in]`` layout, so loading is a copy, never a transpose (on a CPU the engine
then stores the dense projections ``[in, out]``: weight_layout.py).
Routed experts are stacked: ``w1``/``w3`` are ``[E, I, D]`` and ``w2`` is ``[E, D, I]``.

Dtype policy mirrors the reference: hyper-connection weights, norms, sinks, the
compressors' positional bias (``ape``) and the router's score-correction bias stay
fp32 whatever the model dtype; ``tid2eid`` is int32.
"""

from __future__ import annotations

from typing import Any

from deepinfer.config import CSA, HASH_MOE, HCA, SLIDING, ModelConfig
from deepinfer.params import FLOAT32, INT32, ParamSpec


def _norm(dim: int, axis: str = "embed") -> ParamSpec:
    return ParamSpec((dim,), (axis,), init="ones", dtype=FLOAT32)


def _hc_mixer(cfg: ModelConfig, n_out: int, n_scales: int) -> dict[str, ParamSpec]:
    """Hyper-connection projection from the flattened streams to mixing logits."""
    flat = cfg.hc_mult * cfg.hidden_size
    return {
        "fn": ParamSpec((n_out, flat), ("hc_mix", "hc_embed"), dtype=FLOAT32),
        "base": ParamSpec((n_out,), ("hc_mix",), init="zeros", dtype=FLOAT32),
        "scale": ParamSpec((n_scales,), (None,), init="ones", dtype=FLOAT32),
    }


def hc_block_spec(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """pre (hc) + post (hc) + comb (hc*hc) logits, three scales."""
    return _hc_mixer(cfg, (2 + cfg.hc_mult) * cfg.hc_mult, 3)


def hc_head_spec(cfg: ModelConfig) -> dict[str, ParamSpec]:
    return _hc_mixer(cfg, cfg.hc_mult, 1)


def _compressor_spec(cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool) -> dict[str, ParamSpec]:
    """Per-token kv/gate projections (2x wide when windows overlap), positional bias, row norm."""
    width = (2 if overlap else 1) * head_dim
    d = cfg.hidden_size
    return {
        "wkv": ParamSpec((width, d), ("compress_kv", "embed")),
        "wgate": ParamSpec((width, d), ("compress_kv", "embed")),
        "ape": ParamSpec((ratio, width), (None, "compress_kv"), init="zeros", dtype=FLOAT32),
        "norm": _norm(head_dim, "compress_kv"),
    }


def attention_spec(cfg: ModelConfig, layer_type: str) -> dict[str, Any]:
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    g, r = cfg.o_groups, cfg.o_lora_rank
    spec: dict[str, Any] = {
        "wq_a": ParamSpec((cfg.q_lora_rank, d), ("q_lora", "embed")),
        "q_norm": _norm(cfg.q_lora_rank, "q_lora"),
        "wq_b": ParamSpec((h * hd, cfg.q_lora_rank), ("q_heads", "q_lora")),
        "wkv": ParamSpec((hd, d), ("kv", "embed")),
        "kv_norm": _norm(hd, "kv"),
        # Grouped output projection: group g maps its H*hd/G inputs to R outputs.
        "wo_a": ParamSpec((g * r, h * hd // g), ("o_lora", "o_group_in")),
        "wo_b": ParamSpec((d, g * r), ("embed", "o_lora")),
        "sink": ParamSpec((h,), ("heads",), init="zeros", dtype=FLOAT32),
    }
    if layer_type == CSA:
        spec["compressor"] = _compressor_spec(cfg, cfg.csa_compress_ratio, hd, overlap=True)
        spec["indexer"] = {
            "compressor": _compressor_spec(cfg, cfg.csa_compress_ratio, cfg.index_head_dim, overlap=True),
            "wq_b": ParamSpec((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), ("index_heads", "q_lora")),
            "weights_proj": ParamSpec((cfg.index_n_heads, d), ("index_heads", "embed")),
        }
    elif layer_type == HCA:
        spec["compressor"] = _compressor_spec(cfg, cfg.hca_compress_ratio, hd, overlap=False)
    else:
        assert layer_type == SLIDING, layer_type
    return spec


def moe_spec(cfg: ModelConfig, mlp_type: str) -> dict[str, Any]:
    d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    # the router stays whole on every device (a top-k over a split score vector would gather it):
    # its axis is "router", not "experts"
    gate: dict[str, ParamSpec] = {"weight": ParamSpec((e, d), ("router", "embed"))}
    if mlp_type == HASH_MOE:
        gate["tid2eid"] = ParamSpec(
            (cfg.vocab_size, cfg.num_experts_per_tok), ("vocab", None), init="expert_table", dtype=INT32, high=e
        )
    else:
        gate["bias"] = ParamSpec((e,), ("router",), init="zeros", dtype=FLOAT32)
    spec: dict[str, Any] = {
        "gate": gate,
        "experts": {
            # "expert_mlp", not "mlp": split over "tp" only when the experts themselves are not
            "w1": ParamSpec((e, i, d), ("experts", "expert_mlp", "embed")),
            "w2": ParamSpec((e, d, i), ("experts", "embed", "expert_mlp")),
            "w3": ParamSpec((e, i, d), ("experts", "expert_mlp", "embed")),
        },
    }
    if cfg.n_shared_experts:
        s = cfg.shared_intermediate_size
        spec["shared"] = {
            "w1": ParamSpec((s, d), ("mlp", "embed")),
            "w2": ParamSpec((d, s), ("embed", "mlp")),
            "w3": ParamSpec((s, d), ("mlp", "embed")),
        }
    return spec


def block_spec(cfg: ModelConfig, layer_type: str, mlp_type: str) -> dict[str, Any]:
    return {
        "hc_attn": hc_block_spec(cfg),
        "attn_norm": _norm(cfg.hidden_size),
        "attn": attention_spec(cfg, layer_type),
        "hc_ffn": hc_block_spec(cfg),
        "ffn_norm": _norm(cfg.hidden_size),
        "ffn": moe_spec(cfg, mlp_type),
    }


def mtp_spec(cfg: ModelConfig, layer_type: str) -> dict[str, Any]:
    d = cfg.hidden_size
    return {
        "enorm": _norm(d),
        "hnorm": _norm(d),
        "e_proj": ParamSpec((d, d), ("embed", "embed_in")),
        "h_proj": ParamSpec((d, d), ("embed", "embed_in")),
        "block": block_spec(cfg, layer_type, "moe"),
        "hc_head": hc_head_spec(cfg),
        "norm": _norm(d),
    }


def model_spec(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, Any]:
    """The whole model. ``include_mtp=False`` leaves out the MTP blocks (transformers checkpoints lack them)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    spec: dict[str, Any] = {
        "embed": ParamSpec((v, d), ("vocab", "embed")),
        "layers": [block_spec(cfg, lt, mt) for lt, mt in zip(cfg.layer_types, cfg.mlp_layer_types)],
        "hc_head": hc_head_spec(cfg),
        "norm": _norm(d),
    }
    if not cfg.tie_word_embeddings:
        spec["head"] = ParamSpec((v, d), ("vocab", "embed"))
    if include_mtp and cfg.num_nextn_predict_layers:
        spec["mtp"] = [mtp_spec(cfg, lt) for lt in cfg.mtp_layer_types]
    return spec
