"""Compile each chosen kernel once, at start, on the model's own extents; fall back to the
reference for an op whose kernel does not lower on this platform.

Pallas' GPU lowering refuses some extents (Triton: block shapes that are not powers of
two) and the failure would otherwise surface at warm-up as a compile error of the whole
step. The probe traces each op alone, one token wide, with the layer's real head,
window, ring, page and expert extents (the ones the kernels tile by), so a refusal is
found in a second and the engine starts on the reference for that op, saying why in
the log. A failure that only the serving token buckets would show is not caught here:
warm-up still fails loudly then.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from deepinfer.models.interface import FlatBatch
from pallas_kernels import grouped_matmul, index_select, sparse_attention
from pallas_kernels.selection import OPS, KernelChoice


@dataclass(frozen=True)
class ProbeExtents:
    """The sizes the kernels see in one layer of the served model."""

    heads: int
    head_dim: int
    window: int
    ring: int  # window ring rows per slot (window + max backtrack)
    page_size: int
    max_pages: int  # block-table width of one request
    index_heads: int
    index_head_dim: int
    index_topk: int
    hidden: int
    expert_width: int
    experts: int
    dtype: str = "bfloat16"


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _attention(e: ProbeExtents, interpret: bool):
    dt, i32 = jnp.dtype(e.dtype), jnp.int32
    one = _spec((1,), i32)
    fb = FlatBatch(positions=one, valid=_spec((1,), jnp.bool_), row=one, slot=one, length=one, start=one, end=one,
                   tables={})
    rows = e.max_pages * e.page_size
    args = (_spec((1, e.heads, e.head_dim), dt), _spec((1, e.head_dim), dt), _spec((1, e.ring, e.head_dim), dt), fb,
            _spec((e.max_pages, e.page_size, e.head_dim), dt), _spec((1, e.max_pages), i32),
            _spec((1, rows), jnp.bool_), _spec((e.heads,), jnp.float32))
    fn = lambda *a: sparse_attention.sparse_attention(*a, scale=1.0, window=e.window, interpret=interpret)  # noqa: E731
    return fn, args


def _indexer(e: ProbeExtents, interpret: bool):
    dt, i32 = jnp.dtype(e.dtype), jnp.int32
    args = (_spec((1, e.index_heads, e.index_head_dim), dt), _spec((1, e.index_heads), jnp.float32),
            _spec((e.max_pages, e.page_size, e.index_head_dim), dt), _spec((1, e.max_pages), i32), _spec((1,), i32))
    fn = lambda *a: index_select.index_select(*a, k=e.index_topk, interpret=interpret)  # noqa: E731
    return fn, args


def _moe(e: ProbeExtents, interpret: bool):
    dt = jnp.dtype(e.dtype)
    w_in = _spec((e.experts, e.expert_width, e.hidden), dt)
    args = (_spec((1, e.hidden), dt), w_in, w_in, _spec((e.experts, e.hidden, e.expert_width), dt),
            _spec((e.experts,), jnp.int32))

    def fn(rows, w1, w3, w2, sizes):
        hidden = grouped_matmul.grouped_swiglu(rows, w1, w3, sizes, limit=1.0, interpret=interpret)
        return grouped_matmul.grouped_matmul(hidden, w2, sizes, interpret=interpret)

    return fn, args


_PROBES = {"attention": _attention, "indexer": _indexer, "moe": _moe}


def probe_kernels(choice: KernelChoice, extents: ProbeExtents) -> tuple[KernelChoice, dict[str, str]]:
    """-> (the choice that runs, {op: why its kernel was dropped}) after compiling every op chosen as a kernel."""
    dropped = {}
    for op in OPS:
        if not choice.uses(op):
            continue
        fn, args = _PROBES[op](extents, choice.interpret)
        try:
            jax.jit(fn).lower(*args).compile()
        except Exception as err:  # any lowering or compile refusal: the reference runs instead
            first_line = (str(err).strip().splitlines() or [""])[0][:300]
            dropped[op] = f"{type(err).__name__}: {first_line}"
    return dataclasses.replace(choice, **{op: "ref" for op in dropped}), dropped
