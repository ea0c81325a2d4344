"""Checkpoint tensor names -> paths in the deepinfer parameter tree.

Three spellings reach us:

* official release: ``embed.weight``, ``layers.3.attn.wq_a.weight``,
  ``layers.3.ffn.experts.7.w1.weight``, ``layers.3.hc_attn_fn``, ``mtp.0.e_proj.weight``;
* transformers ``save_pretrained`` (5.24): the official names under a ``model.``
  prefix, except ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``,
  ``head.weight`` and the attention's kv norm spelled ``attn.norm.weight``;
* transformers in memory (``state_dict()``): ``model.layers.3.self_attn.q_a_proj.weight``,
  fused experts ``mlp.experts.gate_up_proj`` [E, 2I, D] and ``mlp.experts.down_proj``.

:func:`resolve` turns any of them into a :class:`TargetRef`: the tree path, plus
the expert index (per-expert tensors are stacked) or the half of a fused
gate/up tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# internal block-relative path -> every on-disk spelling of it (after the scope prefix).
_BLOCK_ALIASES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "hc_attn.fn": ("hc_attn_fn", "attn_hc.fn"),
    "hc_attn.base": ("hc_attn_base", "attn_hc.base"),
    "hc_attn.scale": ("hc_attn_scale", "attn_hc.scale"),
    "hc_ffn.fn": ("hc_ffn_fn", "ffn_hc.fn"),
    "hc_ffn.base": ("hc_ffn_base", "ffn_hc.base"),
    "hc_ffn.scale": ("hc_ffn_scale", "ffn_hc.scale"),
    "attn.sink": ("attn.attn_sink", "self_attn.sinks"),
    "attn.wq_a": ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    "attn.q_norm": ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    "attn.wq_b": ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    "attn.wkv": ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    "attn.kv_norm": ("attn.kv_norm.weight", "attn.norm.weight", "self_attn.kv_norm.weight"),
    "attn.wo_a": ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    "attn.wo_b": ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    "attn.compressor.wkv": ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    "attn.compressor.wgate": ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    "attn.compressor.ape": ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    "attn.compressor.norm": ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    "attn.indexer.compressor.wkv": (
        "attn.indexer.compressor.wkv.weight",
        "self_attn.compressor.indexer.kv_proj.weight",
    ),
    "attn.indexer.compressor.wgate": (
        "attn.indexer.compressor.wgate.weight",
        "self_attn.compressor.indexer.gate_proj.weight",
    ),
    "attn.indexer.compressor.ape": ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    "attn.indexer.compressor.norm": (
        "attn.indexer.compressor.norm.weight",
        "self_attn.compressor.indexer.kv_norm.weight",
    ),
    "attn.indexer.wq_b": ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    "attn.indexer.weights_proj": (
        "attn.indexer.weights_proj.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
    ),
    "ffn.gate.weight": ("ffn.gate.weight", "mlp.gate.weight"),
    "ffn.gate.bias": ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    "ffn.gate.tid2eid": ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    "ffn.shared.w1": ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    "ffn.shared.w2": ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
    "ffn.shared.w3": ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    "ffn.experts.w2": ("mlp.experts.down_proj",),
}

_TOP_ALIASES: dict[str, tuple[str, ...]] = {
    "embed": ("embed.weight", "embed_tokens.weight"),
    "head": ("head.weight", "lm_head.weight"),
    "norm": ("norm.weight",),
    "hc_head.fn": ("hc_head_fn", "hc_head.hc_fn"),
    "hc_head.base": ("hc_head_base", "hc_head.hc_base"),
    "hc_head.scale": ("hc_head_scale", "hc_head.hc_scale"),
}

# MTP-only tensors; everything else under mtp.K. belongs to its block.
_MTP_ALIASES: dict[str, tuple[str, ...]] = {
    "enorm": ("enorm.weight",),
    "hnorm": ("hnorm.weight",),
    "e_proj": ("e_proj.weight",),
    "h_proj": ("h_proj.weight",),
    "norm": ("norm.weight",),
    "hc_head.fn": ("hc_head_fn", "hc_head.hc_fn"),
    "hc_head.base": ("hc_head_base", "hc_head.hc_base"),
    "hc_head.scale": ("hc_head_scale", "hc_head.hc_scale"),
}


def _invert(aliases: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {alias: target for target, names in aliases.items() for alias in names}


_BLOCK = _invert(_BLOCK_ALIASES)
_TOP = _invert(_TOP_ALIASES)
_MTP = _invert(_MTP_ALIASES)

_SCOPED = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"


@dataclass(frozen=True)
class TargetRef:
    """Where one on-disk tensor goes.

    ``path``: dotted tree path ("layers.3.attn.wq_a"). ``expert``: the row of a
    stacked expert tensor, or None. ``fused_half``: for a transformers fused
    gate_up tensor, which tree paths get its first and second halves.
    """

    path: str
    expert: int | None = None
    fused_halves: tuple[str, str] | None = None


def resolve(name: str) -> TargetRef | None:
    """The tree target of a checkpoint tensor name, or None when the name is not a V4 weight."""
    bare = name[len("model.") :] if name.startswith("model.") else name
    if bare in _TOP:
        return TargetRef(_TOP[bare])
    m = _SCOPED.match(bare)
    if not m:
        return None
    scope, index, rest = m.groups()
    prefix = f"{scope}.{index}."
    if scope == "mtp":
        if rest in _MTP:
            return TargetRef(prefix + _MTP[rest])
        prefix += "block."
    if rest in _BLOCK:
        return TargetRef(prefix + _BLOCK[rest])
    e = _EXPERT.match(rest)
    if e:
        return TargetRef(f"{prefix}ffn.experts.{e.group(2)}", expert=int(e.group(1)))
    if rest == _FUSED_GATE_UP:
        return TargetRef(prefix + "ffn.experts.w1", fused_halves=(prefix + "ffn.experts.w1", prefix + "ffn.experts.w3"))
    return None


def official_name(path: str, expert: int | None = None) -> str:
    """The official release's name for a tree path (used to write official-style checkpoints)."""
    def first(aliases: dict[str, tuple[str, ...]], key: str) -> str:
        return aliases[key][0]

    if path in _TOP_ALIASES:
        return first(_TOP_ALIASES, path)
    scope, index, rest = path.split(".", 2)
    prefix = f"{scope}.{index}."
    if scope == "mtp":
        if rest in _MTP_ALIASES:
            return prefix + first(_MTP_ALIASES, rest)
        rest = rest[len("block.") :]
    if rest.startswith("ffn.experts."):
        if expert is None:
            raise ValueError(f"{path} is stacked per expert: pass the expert index")
        return f"{prefix}ffn.experts.{expert}.{rest.rsplit('.', 1)[1]}.weight"
    return prefix + first(_BLOCK_ALIASES, rest)
