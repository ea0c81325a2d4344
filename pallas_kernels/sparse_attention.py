"""The paged sparse attention of one V4 layer over a flat ragged batch, with sinks.

Each token t (of a request row; decode and prefill rows mixed) attends to
(1) its slot's window ring as it was before the step, (2) the step's own tokens of
its request within the window, (3) the compressed rows of its request selected
through its block table (CSA: the indexer's top-k, HCA: every visible row).
Keys are also values (one latent KV head); the per-head sink joins the softmax
denominator only.

``sparse_attention_ref`` is the pure-JAX code the model ran before the kernel (the
normal path of models/deepseek_v4/paged_attention.py): every key set gathered into
one logits row, one softmax. ``sparse_attention`` is a Pallas kernel with one
program per token: it reads the ring by slot, the step's keys as the fixed
``window`` flat positions ending at the token (a row's tokens are contiguous in
the flat batch, so those are the only step keys it can see), and the pool page by
page through the block table, with an online softmax over the three parts in that
fixed order. Nothing a token computes depends on the other tokens of the step or
on the bucket sizes (masked keys add exact zeros), so the kernel keeps
batch-invariant mode's contract by construction: no split-KV, no batch-dependent
tiles.

GPU lowering: Pallas' Triton backend (one program per token with data-dependent
page reads maps onto Triton's program model directly; Mosaic GPU's warpgroup
pipelines would pay off for long prefill chunks, later). Triton wants
power-of-two block extents (heads, head_dim, window, ring size, page size, rows
per token); V4-Flash's are, except the ring (window + backtrack): on a GPU the
probe at start (pallas_kernels/probe.py) falls back to the reference if lowering
fails. Not yet run on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer.models.interface import FlatBatch
from deepinfer.numerics import fixed_sum


def ring_positions(lengths: jax.Array, size: int) -> jax.Array:
    """[B] committed lengths -> [B, size] the position each ring index holds (the latest
    p < length with p % size == index), or -1 when the index was never filled."""
    idx = jnp.arange(size)
    last = lengths[:, None] - 1
    pos = last - jnp.mod(last - idx[None, :], size)
    return jnp.where(pos >= 0, pos, -1)


def gather_rows(pool: jax.Array, table: jax.Array) -> jax.Array:
    """pool [pages, page_size, d], table [T, max_pages] -> each token's request rows [T, max_pages * page_size, d]."""
    rows = jnp.take(pool, table, axis=0, mode="clip")
    return rows.reshape(table.shape[0], -1, pool.shape[-1])


def sink_softmax(logits: jax.Array, sink: jax.Array) -> jax.Array:
    """Softmax over the last axis with an extra sink logit in the denominator only (never NaN)."""
    peak = jnp.maximum(jnp.max(logits, axis=-1), sink)
    weights = jnp.exp(logits - peak[..., None])
    return weights / (fixed_sum(weights, axis=-1) + jnp.exp(sink - peak))[..., None]


def attend_parts(q, parts, sink, scale):
    """Sink softmax over several key sets. q [T, H, hd]; parts: (keys, mask, shared) with keys
    [T, K, hd] per token or [K, hd] shared by all tokens, mask [T, K]. Returns [T, H, hd]."""
    logits = []
    for keys, mask, shared in parts:
        eq = "thd,kd->thk" if shared else "thd,tkd->thk"
        lg = jnp.einsum(eq, q.astype(jnp.float32), keys.astype(jnp.float32)) * scale
        logits.append(jnp.where(mask[:, None, :], lg, -jnp.inf))
    probs = sink_softmax(jnp.concatenate(logits, axis=-1), sink.astype(jnp.float32)[None, :])
    out, at = 0.0, 0
    for keys, _, shared in parts:
        k = keys.shape[0] if shared else keys.shape[1]
        pr = probs[..., at : at + k]
        eq = "thk,kd->thd" if shared else "thk,tkd->thd"
        out = out + jnp.einsum(eq, pr, keys.astype(jnp.float32))
        at += k
    return out.astype(q.dtype)


def first_position(fb: FlatBatch) -> jax.Array:
    """[T] the first position each token's slot holds: positions before history_start were never
    processed into the slot (a replay from an empty state)."""
    return jnp.zeros_like(fb.positions) if fb.history_start is None else fb.history_start


def sparse_attention_ref(q, kv, ring, fb: FlatBatch, pool, table, selected, sink, *, scale: float, window: int,
                         interpret: bool = False):
    """q [T, H, hd]; kv [T, hd] the step's keys; ring [slots, keep, hd] the window rings before the step;
    pool [pages, page_size, hd] / table [T, max_pages] / selected [T, max_pages * page_size] bool, or
    all None (a sliding-only layer); sink [H]. Returns [T, H, hd] in q's dtype."""
    ring_pos = ring_positions(fb.length, ring.shape[1])
    d = fb.positions[:, None] - ring_pos
    own = jnp.take(ring, fb.slot, axis=0, mode="clip")
    parts = [(own, (ring_pos >= first_position(fb)[:, None]) & (d >= 0) & (d < window), False)]
    d2 = fb.positions[:, None] - fb.positions[None, :]
    step_mask = (fb.row[:, None] == fb.row[None, :]) & fb.valid[None, :] & (d2 >= 0) & (d2 < window)
    parts.append((kv, step_mask, True))
    if pool is not None:
        parts.append((gather_rows(pool, table), selected, False))
    return attend_parts(q, parts, sink, scale)


def _online_block(qf, keys, mask, carry, scale):
    """One key block into the running (max, denominator, numerator) of every head, in fp32."""
    m, l, acc = carry
    kf = keys.astype(jnp.float32)
    lg = jnp.dot(qf, kf.T, preferred_element_type=jnp.float32) * scale
    lg = jnp.where(mask[None, :], lg, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(lg, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(lg - m_new[:, None])
    acc = acc * alpha[:, None] + jnp.dot(p, kf, preferred_element_type=jnp.float32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc


def _kernel(meta_ref, q_ref, kv_ref, ring_ref, sink_ref, *rest, scale, window, page_size, num_pages):
    if num_pages:
        table_ref, sel_ref, pool_ref, out_ref = rest
    else:
        (out_ref,) = rest
    t = pl.program_id(0)
    slot, pos, length, start, first = (meta_ref[0, i] for i in range(5))
    qf = q_ref[0].astype(jnp.float32)
    sink = sink_ref[...].astype(jnp.float32)
    # the sink as the first "key": the running max starts there and its weight exp(0) = 1 is in the denominator
    carry = (sink, jnp.ones_like(sink), jnp.zeros(qf.shape, jnp.float32))

    rpos = ring_positions(jnp.reshape(length, (1,)), ring_ref.shape[1])[0]  # -1: never filled, below first
    d = pos - rpos
    carry = _online_block(qf, ring_ref[slot], (rpos >= first) & (d >= 0) & (d < window), carry, scale)

    # kv is front-padded by window - 1 rows: flat positions t - window + 1 .. t are rows t .. t + window - 1
    flat = t - window + 1 + jnp.arange(window)
    carry = _online_block(qf, kv_ref[pl.ds(t, window)], flat >= start, carry, scale)

    if num_pages:
        def page(j, carry):
            sel = sel_ref[0, pl.ds(j * page_size, page_size)] != 0
            return _online_block(qf, pool_ref[table_ref[0, j]], sel, carry, scale)

        carry = jax.lax.fori_loop(0, num_pages, page, carry)
    _, l, acc = carry
    out_ref[0] = (acc / l[:, None]).astype(out_ref.dtype)


def sparse_attention(q, kv, ring, fb: FlatBatch, pool, table, selected, sink, *, scale: float, window: int,
                     interpret: bool = False):
    """The Pallas kernel of sparse_attention_ref (same arguments, same result up to fp32 rounding)."""
    t_count, heads, hd = q.shape
    slots = ring.shape[0]
    meta = jnp.stack([jnp.clip(fb.slot, 0, slots - 1), fb.positions, fb.length, fb.start, first_position(fb)],
                     axis=1).astype(jnp.int32)
    kv_pad = jnp.concatenate([jnp.zeros((window - 1, hd), kv.dtype), kv])
    whole = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)  # noqa: E731  (read by index in the kernel)
    per_token = lambda a: pl.BlockSpec((1, *a.shape[1:]), lambda t: (t,) + (0,) * (a.ndim - 1))  # noqa: E731
    args = [meta, q, kv_pad, ring, sink]
    specs = [per_token(meta), per_token(q), whole(kv_pad), whole(ring), whole(sink)]
    num_pages = page_size = 0
    if pool is not None:
        num_pages, page_size = table.shape[1], pool.shape[1]
        table = jnp.clip(table, 0, pool.shape[0] - 1).astype(jnp.int32)
        sel = selected.astype(jnp.int32)
        args += [table, sel, pool]
        specs += [per_token(table), per_token(sel), whole(pool)]
    kernel = functools.partial(_kernel, scale=scale, window=window, page_size=page_size, num_pages=num_pages)
    return pl.pallas_call(
        kernel,
        grid=(t_count,),
        in_specs=specs,
        out_specs=pl.BlockSpec((1, heads, hd), lambda t: (t, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
    )(*args)
