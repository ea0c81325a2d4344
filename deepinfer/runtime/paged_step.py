"""The engine's jitted step: a packed plan in, sampled tokens (and their logits) out, state updated.

One program per (token bucket, row bucket); the state is donated.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from deepinfer.config import ModelConfig
from deepinfer.engine.plan import FLOAT_FIELDS_R, INT_FIELDS_R, INT_FIELDS_T, PlanShape
from deepinfer.kv.paged_state import PagedLayout
from deepinfer.models.deepseek_v4.block import block
from deepinfer.models.deepseek_v4.model import embed, lm_head
from deepinfer.models.deepseek_v4.paged_attention import FlatBatch, paged_attention
from deepinfer.runtime.sampler import sample


def unpack(shape: PlanShape, pools: tuple[str, ...], ints: jax.Array, floats: jax.Array):
    """Inverse of engine.plan.pack (static offsets)."""
    t, r = shape.num_tokens, shape.num_rows
    out, at = {}, 0
    for f in INT_FIELDS_T:
        out[f], at = ints[at : at + t], at + t
    for f in INT_FIELDS_R:
        out[f], at = ints[at : at + r], at + r
    tables = {}
    for name, m in zip(pools, shape.max_pages):
        tables[name], at = ints[at : at + r * m].reshape(r, m), at + r * m
    for i, f in enumerate(FLOAT_FIELDS_R):
        out[f] = floats[i * r : (i + 1) * r]
    return out, tables


def _attention_into(out: dict, key: int, cfg, p, layer_type, st, fb, page_size):
    def fn(x):
        y, new_st = paged_attention(cfg, p, layer_type, st, x[0], fb, page_size)
        out[key] = new_st
        return y[None], {}

    return fn


def paged_step(
    cfg: ModelConfig,
    layout: PagedLayout,
    shape: PlanShape,
    params: dict,
    state: dict,
    ints: jax.Array,
    floats: jax.Array,
) -> tuple[jax.Array, jax.Array, dict]:
    """Returns (sampled tokens [R], logits [R, V] at each row's last token, new state).

    Plan tokens of -1 are placeholders for a request's previous sampled token,
    read from ``state["last_token"][slot]``; this step's samples are written there.
    """
    pools = tuple(name for name, _ in layout.num_pages)
    f, tables = unpack(shape, pools, ints, floats)
    row = f["token_row"]
    fb = FlatBatch(
        positions=f["positions"],
        valid=f["valid"] > 0,
        row=row,
        slot=f["slot"][row],
        length=f["length"][row],
        start=f["start"][row],
        end=f["length"][row] + f["n_new"][row],
        tables={name: tables[name][row] for name in pools},
    )
    last_token = state["last_token"]
    tokens = jnp.where(f["tokens"] < 0, jnp.take(last_token, fb.slot, mode="clip"), f["tokens"])[None]
    h = embed(params, tokens)
    streams = jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], cfg.hc_mult, h.shape[-1]))
    new_layers: dict[int, dict] = {}
    for i, (layer_type, mlp_type) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        p = params["layers"][i]
        fn = _attention_into(new_layers, i, cfg, p["attn"], layer_type, state["layers"][i], fb, layout.page_size)
        streams, _ = block(cfg, p, mlp_type, streams, tokens, fn)
    last = jnp.clip(f["start"] + f["n_new"] - 1, 0, shape.num_tokens - 1)
    logits = lm_head(cfg, params, params["hc_head"], params["norm"], streams[0][last])
    sampled = sample(logits, f["length"] + f["n_new"], f["seed"], f["temperature"], f["top_k"], f["top_p"])
    writes = jnp.where(f["sample"] > 0, f["slot"], last_token.shape[0])  # padding / mid-prompt rows: dropped
    new_state = {
        "layers": [new_layers[i] for i in range(cfg.num_hidden_layers)],
        "last_token": last_token.at[writes].set(sampled, mode="drop"),
    }
    return sampled, logits, new_state


# One program per static (config, layout, plan shape); the state is updated in place.
paged_step_jit = jax.jit(paged_step, static_argnums=(0, 1, 2), donate_argnums=(4,))
