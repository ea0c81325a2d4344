"""On a CPU the dense projections are stored [in, out] (models/deepseek_v4/weight_layout.py): exactly
those leaves, their values the transposes, shardings with the axes swapped, quantized leaves and
routed experts as they were, and the model's numbers the same within fp32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4 import ops, weight_layout
from deepinfer.models.deepseek_v4.model import forward
from deepinfer.models.deepseek_v4.param_tree import mtp_spec
from deepinfer.models.deepseek_v4.weight_layout import InOut
from deepinfer.params import init_params
from deepinfer.quant.formats import FP8_BLOCK, QuantizedArray, is_quantized
from deepinfer.quant.quantize import FP8_BLOCK_SHAPE, quantize_fp8_block
from deepinfer.runtime.engine import LLMEngine
from tests.reference import load_case

PROJECTIONS = {"wq_a", "wq_b", "wkv", "wo_b", "wgate", "weights_proj", "e_proj", "h_proj", "weight", "w1", "w2", "w3",
               "head"}


def _leaves(tree):
    keys = lambda path: tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)  # noqa: E731
    leaf = lambda x: isinstance(x, InOut) or is_quantized(x)  # noqa: E731
    return {keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf)[0]}


def test_on_a_cpu_exactly_the_dense_projections_are_stored_transposed():
    case = load_case("mixed")
    # with an MTP block (its e_proj / h_proj, and its own block's projections)
    params = dict(case.params, mtp=[init_params(mtp_spec(case.cfg, case.cfg.layer_types[0]), jax.random.key(1))])
    before = _leaves(params)
    after = _leaves(weight_layout.for_platform(params, "cpu"))
    assert before.keys() == after.keys()
    moved = {path for path, x in after.items() if isinstance(x, InOut)}
    assert {path[-1] for path in moved} == PROJECTIONS
    for path in moved:
        assert after[path].shape == before[path].shape  # (the logical [out, in] shape)
        np.testing.assert_array_equal(np.asarray(after[path].t), np.asarray(before[path]).T)
        # the routed experts' w1/w2/w3 are stacked [E, out, in] and stay; the shared expert's move
        assert "experts" not in path and (path[-1] not in ("w1", "w2", "w3") or "shared" in path)
    for path in before.keys() - moved:
        assert after[path] is before[path]
    assert any("experts" in path for path in before)


def test_other_platforms_and_laid_out_trees_are_left_alone():
    params = load_case("mixed").params
    assert weight_layout.for_platform(params, "gpu") is params
    laid = weight_layout.for_platform(params, "cpu")
    again = _leaves(weight_layout.for_platform(laid, "cpu"))
    for path, x in _leaves(laid).items():
        assert (again[path].t if isinstance(x, InOut) else again[path]) is (x.t if isinstance(x, InOut) else x)


def test_quantized_weights_stay_as_stored():
    params = load_case("mixed").params
    q, scale = quantize_fp8_block(np.asarray(params["layers"][0]["attn"]["wq_a"]))
    kept = QuantizedArray(jnp.asarray(q), jnp.asarray(scale), FP8_BLOCK, FP8_BLOCK_SHAPE, jnp.float32)
    laid = weight_layout.for_platform({"attn": {"wq_a": kept, "wq_b": params["layers"][0]["attn"]["wq_b"]}}, "cpu")
    assert laid["attn"]["wq_a"] is kept and isinstance(laid["attn"]["wq_b"], InOut)


def test_a_sharded_weight_keeps_its_split_on_the_swapped_axis():
    devices = np.asarray(jax.devices()[:2])
    mesh = jax.sharding.Mesh(devices, ("tp",))
    w = jax.device_put(np.arange(8 * 6, dtype=np.float32).reshape(8, 6),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None)))
    laid = weight_layout.for_platform({"attn": {"wq_a": w}}, "cpu")["attn"]["wq_a"]
    assert laid.t.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    np.testing.assert_array_equal(np.asarray(laid.t), np.asarray(w).T)


def test_linear_and_the_model_give_the_same_numbers_in_either_layout():
    case = load_case("mixed")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(24, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 16)), jnp.float32)
    np.testing.assert_allclose(np.asarray(ops.linear(x, InOut(w.T))), np.asarray(ops.linear(x, w)), rtol=1e-5, atol=1e-6)
    tokens = jnp.asarray(rng.integers(0, case.cfg.vocab_size, (2, 9)), jnp.int32)
    run = jax.jit(forward, static_argnums=0)
    want = np.asarray(run(case.cfg, case.params, tokens))
    got = np.asarray(run(case.cfg, weight_layout.for_platform(case.params, "cpu"), tokens))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_the_engine_on_a_cpu_holds_the_laid_out_weights():
    case = load_case("mixed")
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_seqs=2, max_model_len=64))
    layer = engine.params["layers"][0]
    assert isinstance(layer["attn"]["wq_a"], InOut) and isinstance(layer["ffn"]["gate"]["weight"], InOut)
    assert not isinstance(layer["ffn"]["experts"]["w1"], InOut)
    # an uncommitted weight stays so: a committed one would miss the programs compiled ahead at warm-up
    assert layer["attn"]["wq_a"].t.committed == case.params["layers"][0]["attn"]["wq_a"].committed


def test_checkpoint_layout_undoes_it():
    params = load_case("mixed").params
    back = _leaves(weight_layout.checkpoint_layout(weight_layout.for_platform(params, "cpu")))
    for path, x in _leaves(params).items():
        assert not isinstance(back[path], InOut)
        np.testing.assert_array_equal(np.asarray(back[path]), np.asarray(x))
    assert weight_layout.checkpoint_layout(params) is params


def test_an_engine_placing_another_engines_weights_reads_them_in_the_loaded_layout():
    """(EPLB on one device puts the experts into slots first: placement, which reads the loaded tree)"""
    case = load_case("mixed")
    first = LLMEngine(case.cfg, case.params, EngineConfig(max_num_seqs=2, max_model_len=64))
    second = LLMEngine(case.cfg, first.params, EngineConfig(max_num_seqs=2, max_model_len=64, enable_eplb=True,
                                                            num_redundant_experts=2))
    attn = second.params["layers"][0]["attn"]
    assert isinstance(attn["wq_a"], InOut)
    np.testing.assert_array_equal(np.asarray(attn["wq_a"].t), np.asarray(case.params["layers"][0]["attn"]["wq_a"]).T)
