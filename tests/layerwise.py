"""Layer-by-layer comparison against transformers: which sub-layer diverges first.

Runs the torch reference with forward hooks and deepinfer's
``forward_with_intermediates`` on the same tokens, then walks the sub-layers in
execution order — per layer: hc_attn (collapsed + normed attention input),
compressor (compressed rows), indexer (top-k selection), attention, hc_ffn,
moe, block (output streams) — and finally the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import torch

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4 import forward_with_intermediates

REL_TOL = 1e-4


@dataclass
class Comparison:
    name: str
    max_abs_diff: float
    scale: float
    exact: bool = False  # selections compare exactly

    @property
    def ok(self) -> bool:
        if self.exact:
            return self.max_abs_diff == 0
        return self.max_abs_diff <= REL_TOL * max(self.scale, 1e-6)


def _capture_reference(model, tokens: np.ndarray) -> dict[str, np.ndarray]:
    captured: dict[str, np.ndarray] = {}
    hooks = []

    def save(name, pick):
        def hook(_module, _inputs, output):
            captured[name] = pick(output).detach().float().numpy()

        return hook

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        hooks.append(layer.input_layernorm.register_forward_hook(save(f"layers.{i}.hc_attn", lambda o: o)))
        if attn.compressor is not None:
            hooks.append(attn.compressor.register_forward_hook(save(f"layers.{i}.compressor", lambda o: o[0][:, 0])))
            if hasattr(attn.compressor, "indexer"):
                hooks.append(attn.compressor.indexer.register_forward_hook(save(f"layers.{i}.indexer", lambda o: o)))
        hooks.append(attn.register_forward_hook(save(f"layers.{i}.attention", lambda o: o[0])))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(save(f"layers.{i}.hc_ffn", lambda o: o)))
        hooks.append(layer.mlp.register_forward_hook(save(f"layers.{i}.moe", lambda o: o)))
        hooks.append(layer.register_forward_hook(save(f"layers.{i}.block", lambda o: o)))
    try:
        with torch.no_grad():
            captured["logits"] = model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return captured


def _selection_mask(indices: np.ndarray, n_rows: int) -> np.ndarray:
    """Reference top-k indices [B, S, k] (-1 = invalid) -> bool mask [B, S, n_rows]."""
    mask = np.zeros((*indices.shape[:-1], n_rows + 1), bool)
    np.put_along_axis(mask, np.where(indices >= 0, indices, n_rows), True, axis=-1)
    return mask[..., :n_rows]


def compare_layers(cfg: ModelConfig, params: dict, model, tokens: np.ndarray) -> list[Comparison]:
    """Every sub-layer's comparison, in execution order."""
    ref = _capture_reference(model, tokens)
    logits, _, layers_aux = jax.jit(forward_with_intermediates, static_argnums=0)(cfg, params, tokens)
    ours = {"logits": np.asarray(logits)}
    for i, aux in enumerate(layers_aux):
        ours[f"layers.{i}.hc_attn"] = aux["attn_in"]
        ours[f"layers.{i}.attention"] = aux["attn"]
        ours[f"layers.{i}.hc_ffn"] = aux["ffn_in"]
        ours[f"layers.{i}.moe"] = aux["moe"]
        ours[f"layers.{i}.block"] = aux["out"]
        if "attn.compressed" in aux:
            ours[f"layers.{i}.compressor"] = aux["attn.compressed"]
        if "attn.selected" in aux:
            ours[f"layers.{i}.indexer"] = aux["attn.selected"]
    order = []
    for i in range(cfg.num_hidden_layers):
        order += [f"layers.{i}.{s}" for s in ("hc_attn", "compressor", "indexer", "attention", "hc_ffn", "moe", "block")]
    order.append("logits")

    results = []
    for name in order:
        if name not in ref:
            continue
        r, o = ref[name], np.asarray(ours[name])
        if name.endswith("indexer"):
            r = _selection_mask(r.astype(np.int64), o.shape[-1])
            results.append(Comparison(name, float(np.sum(r != o)), float(r.size), exact=True))
            continue
        if r.shape != o.shape:
            raise AssertionError(f"{name}: reference shape {r.shape} != deepinfer shape {o.shape}")
        if r.size == 0:  # e.g. no complete compression window yet: shapes agreeing is the comparison
            results.append(Comparison(name, 0.0, 0.0))
            continue
        results.append(Comparison(name, float(np.max(np.abs(r - o))), float(np.max(np.abs(r)))))
    return results


def first_divergence(results: list[Comparison]) -> Comparison | None:
    return next((c for c in results if not c.ok), None)


def describe(c: Comparison) -> str:
    if c.exact:
        return f"{c.name}: {int(c.max_abs_diff)} of {int(c.scale)} selections differ"
    return f"{c.name}: max|Δ| = {c.max_abs_diff:.3g} vs max|ref| = {c.scale:.3g} (tolerance {REL_TOL:g} relative)"
