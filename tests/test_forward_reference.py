"""deepinfer's V4 forward equals transformers' DeepseekV4ForCausalLM (fp32, eager)."""

import jax
import numpy as np
import pytest

from deepinfer.models.deepseek_v4 import forward, forward_with_intermediates
from tests.layerwise import compare_layers, describe, first_divergence
from tests.reference import TINY_CONFIGS, load_case, reference_logits

TOLERANCE = 1e-4  # max|Δ| <= TOLERANCE * max|logit|


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_logits_match_transformers(name):
    case = load_case(name)
    ref = reference_logits(case.model, case.tokens)
    ours = np.asarray(jax.jit(forward, static_argnums=0)(case.cfg, case.params, case.tokens))
    err, scale = np.max(np.abs(ours - ref)), np.max(np.abs(ref))
    if err > TOLERANCE * scale:
        # Name the first sub-layer that diverges, so the failure says where to look.
        first = first_divergence(compare_layers(case.cfg, case.params, case.model, case.tokens))
        pytest.fail(f"logits differ by {err:.3g} (max|logit| {scale:.3g}); first divergence: "
                    + (describe(first) if first else "none found layer by layer"))
    # The comparison must be about real numbers: logits vary across positions and tokens.
    assert scale > 1.0 and np.std(ref) > 0.1


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_every_sub_layer_matches(name):
    case = load_case(name)
    results = compare_layers(case.cfg, case.params, case.model, case.tokens)
    first = first_divergence(results)
    assert first is None, describe(first)
    # Each attention type's internals were actually compared.
    compared = {r.name.split(".")[-1] for r in results}
    if any(t == "compressed_sparse_attention" for t in case.cfg.layer_types):
        assert {"compressor", "indexer"} <= compared


def test_configs_exercise_what_they_claim():
    """The tiny configs cover: more visible rows than index_topk (so top-k really drops rows),
    prompts shorter than the window, prompts spanning many compressed rows, batch > 1."""
    case = load_case("mixed")
    _, _, aux = jax.jit(forward_with_intermediates, static_argnums=0)(case.cfg, case.params, case.tokens)
    csa = next(i for i, t in enumerate(case.cfg.layer_types) if t == "compressed_sparse_attention")
    selected = np.asarray(aux[csa]["attn.selected"])
    ratio = case.cfg.csa_compress_ratio
    visible_last = (case.tokens.shape[1]) // ratio
    assert visible_last > case.cfg.index_topk
    assert selected[:, -1].sum(-1).tolist() == [case.cfg.index_topk] * case.tokens.shape[0]
    assert case.tokens.shape[0] > 1

    short = load_case("short_prompt")
    assert short.tokens.shape[1] < short.cfg.sliding_window and short.tokens.shape[0] > 1

    dense = load_case("dense_compression")
    assert dense.tokens.shape[1] // dense.cfg.csa_compress_ratio >= 16
    assert dense.tokens.shape[1] % dense.cfg.csa_compress_ratio and dense.tokens.shape[1] % dense.cfg.hca_compress_ratio


def test_layerwise_helper_names_the_broken_sub_layer():
    """Corrupting one of our weights makes the helper point at that sub-layer.

    (Layer 1, not 0, for hc_attn: at layer 0 all streams are equal, so the collapse
    weights only rescale the input and the following RMSNorm removes that.)
    """
    case = load_case("mixed")
    cases = {
        ("layers", 1, "attn", "compressor", "wkv"): "layers.1.compressor",
        ("layers", 3, "attn", "indexer", "wq_b"): "layers.3.indexer",
        ("layers", 2, "ffn", "experts", "w2"): "layers.2.moe",
        ("layers", 1, "hc_attn", "fn"): "layers.1.hc_attn",
    }
    for path, expected in cases.items():
        params = jax.tree.map(lambda x: x, case.params)
        node = params
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = -node[path[-1]] * 1.5
        first = first_divergence(compare_layers(case.cfg, params, case.model, case.tokens))
        assert first is not None and first.name == expected, (path, first)
