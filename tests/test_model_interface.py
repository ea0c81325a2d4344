"""The runtime talks to a model family only through models/interface.py.

Structural checks (no runtime module imports a family's internals; the interface names
no family; no file over 400 lines), and a second, non-V4 family run end to end through
LLMEngine, generate() and Decoder: a dense causal model whose attention is a uniform mean
over a paged KV pool of one row per token (Llama-shaped state), checked against numpy.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deepinfer
from deepinfer.engine_config import EngineConfig
from deepinfer.models.interface import FlatBatch, PoolInfo
from deepinfer.models.registry import family_for
from deepinfer.runtime.decoder import Decoder, StateLayout
from deepinfer.runtime.engine import LLMEngine
from deepinfer.scheduler.sampling_params import SamplingParams
from tests.reference import load_case

PACKAGE = pathlib.Path(deepinfer.__file__).parent
ALLOWED_MODEL_IMPORTS = {"deepinfer.models.interface", "deepinfer.models.registry"}


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_runtime_reaches_models_only_through_the_interface_and_registry():
    offenders = {}
    for path in sorted((PACKAGE / "runtime").glob("*.py")):
        bad = {n for n in _imports(path) if n.startswith("deepinfer.models")} - ALLOWED_MODEL_IMPORTS
        bad = {n for n in bad if not any(n.startswith(a + ".") for a in ALLOWED_MODEL_IMPORTS)}
        if bad:
            offenders[path.name] = sorted(bad)
    assert offenders == {}
    # and the check itself sees imports: the registry does name the V4 package
    assert any(n.startswith("deepinfer.models.deepseek_v4") for n in _imports(PACKAGE / "models" / "registry.py"))


def test_the_interface_names_no_model_family():
    text = (PACKAGE / "models" / "interface.py").read_text()
    found = re.findall(r"(?i)deepseek|\bv4\b|\bcsa\b|\bhca\b|\bmtp\b|hyper.?connection|sinkhorn", text)
    assert found == []
    assert not any(n.startswith("deepinfer.models.") and n != "deepinfer.models.interface"
                   for n in _imports(PACKAGE / "models" / "interface.py"))


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_v4_state_axes_match_the_state():
    case = load_case("mixed")
    family = family_for(case.cfg)
    layout = StateLayout(batch=3, max_len=64).paged(family, case.cfg)
    state = jax.eval_shape(lambda: family.init_state(case.cfg, layout, jnp.float32))
    axes = family.state_axes(case.cfg, layout)
    flat_state, tree = jax.tree.flatten(state)
    flat_axes = tree.flatten_up_to(axes)
    pools = {p.name for p in family.pools(case.cfg)}
    for leaf, ax in zip(flat_state, flat_axes):
        assert len(ax) == leaf.ndim
        lead = layout.num_slots if ax[0] == "slot" else layout.pages(ax[0].removeprefix("pages:"))
        assert ax[0] == "slot" or ax[0].removeprefix("pages:") in pools
        assert leaf.shape[0] == lead


# -- a second family: uniform causal attention over a paged KV pool ---------------------


@dataclass(frozen=True)
class MeanConfig:
    """Just the fields the runtime reads from any config."""

    vocab_size: int = 37
    dim: int = 8
    eos_token_ids: tuple[int, ...] = ()
    batch_invariant: bool = False

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class MeanAttention:
    """hidden(t) = mean of the embeddings of the request's tokens 0..t; logits = hidden @ out.T."""

    draft_forward: None = None

    def param_specs(self, cfg):
        return {}

    def pools(self, cfg):
        return (PoolInfo("kv", 1),)

    def init_state(self, cfg, layout, dtype):
        return {"kv": jnp.zeros((layout.pages("kv"), layout.page_size, cfg.dim), dtype)}

    def state_axes(self, cfg, layout):
        return {"kv": ("pages:kv", None, "embed")}

    def forward(self, cfg, params, tokens):
        x = params["embed"][tokens]
        mean = jnp.cumsum(x, axis=1) / jnp.arange(1, tokens.shape[1] + 1)[None, :, None]
        return self.logits(cfg, params, mean)

    def paged_forward(self, cfg, params, state, tokens, fb: FlatBatch, page_size):
        x = params["embed"][tokens]
        table = fb.tables["kv"]
        page = jnp.take_along_axis(table, (fb.positions // page_size)[:, None], axis=1, mode="clip")[:, 0]
        page = jnp.where(fb.valid, page, state["kv"].shape[0])
        pool = state["kv"].at[page, fb.positions % page_size].set(x, mode="drop")
        rows = jnp.take(pool, table, axis=0, mode="clip").reshape(table.shape[0], -1, cfg.dim)
        seen = jnp.arange(rows.shape[1])[None, :] <= fb.positions[:, None]
        mean = jnp.sum(jnp.where(seen[..., None], rows, 0.0), axis=1) / (fb.positions + 1)[:, None]
        return mean, {"kv": pool}

    def logits(self, cfg, params, hidden):
        return jnp.einsum("...d,vd->...v", hidden, params["out"]).astype(jnp.float32)


def _mean_model():
    cfg = MeanConfig()
    rng = np.random.default_rng(0)
    params = {"embed": jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.dim)), jnp.float32),
              "out": jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.dim)), jnp.float32)}
    return cfg, params


def _greedy_numpy(params, prompt, n):
    emb, out = np.asarray(params["embed"], np.float64), np.asarray(params["out"], np.float64)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(out @ emb[seq].mean(axis=0))))
    return seq[len(prompt):]


def test_a_second_family_runs_through_the_engine():
    cfg, params = _mean_model()
    family = MeanAttention()
    prompts = [[1, 2, 3], [5] * 40, list(range(7, 30))]  # the long ones span several pages and two chunks
    engine = LLMEngine(cfg, params, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96,
                                                 page_size=8), family=family)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
    engine.run_until_done()
    for req, prompt in zip(reqs, prompts):
        assert req.output_token_ids == _greedy_numpy(params, prompt, 12)
    engine.check_all_free()


def test_a_second_family_runs_through_generate_and_decoder():
    cfg, params = _mean_model()
    family = MeanAttention()
    prompts = [[1, 2, 3], list(range(7, 30))]
    out = deepinfer.generate(cfg, params, prompts, max_new_tokens=10, eos_token_ids=(), family=family)
    for row, prompt in zip(np.asarray(out.tokens), prompts):
        assert row.tolist() == _greedy_numpy(params, prompt, 10)

    dec = Decoder(cfg, StateLayout(batch=1, max_len=40), family=family)
    seq = np.asarray([list(range(3, 23))], np.int32)
    logits, state = dec.prefill(params, dec.init_state(), seq, chunk_size=7)
    want = np.asarray(family.forward(cfg, params, jnp.asarray(seq)))
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_backtrack"):
        dec.rollback(state, 13)
