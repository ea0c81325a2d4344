"""Numerics shared by the model and the runtime: sums with a fixed order, and fixed token tiles.

Batch-invariant mode (runtime/batch_invariance.py) rests on these: ``fixed_sum`` gives
a row the same bits whatever the array's size, and ``token_tiled`` runs a per-token
function on fixed-shape tiles. The sampler uses them as much as the model does,
so they live here rather than in a model family's package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# Levels of fixed_sum's tree that may fuse into one kernel (2**4 = 16 leaves per output): XLA
# CPU fuses 4 levels at a time on its own; XLA GPU, left alone, compiled for minutes (see fixed_sum).
FUSED_TREE_LEVELS = 4


def fixed_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over one axis as a pairwise tree of elementwise adds, in a fixed order.

    XLA CPU's reduce picks its loop order (and so its rounding) from the whole
    array's shape: a row of [b, K] sums to different bits for b <= 16 and b >= 32
    (measured, jax 0.10.2). Elementwise adds are exact IEEE operations in the
    order written, so this tree gives every row the same bits whatever the batch.
    Used for every sum a token's result depends on (norms, softmaxes, pooling).

    Every ``FUSED_TREE_LEVELS`` levels the partial sums pass an optimization barrier, so no
    fusion holds more than 2**FUSED_TREE_LEVELS leaves per output. Without them XLA GPU took
    minutes to compile the bundled model's step (24 s of it in priority fusion; H200, jax
    0.11.2), with them 10 s (BENCHMARKS.md §6). The barriers move no arithmetic: same bits.
    """
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (width - n,), x.dtype)], axis=-1)
    level = 0
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
        level += 1
        if level % FUSED_TREE_LEVELS == 0 and x.shape[-1] > 1:
            x = jax.lax.optimization_barrier(x)
    out = x[..., 0]
    return jnp.expand_dims(out, axis) if keepdims else out


def fixed_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax whose denominator is a fixed_sum (batch-independent bits)."""
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / fixed_sum(e, axis, keepdims=True)


def fixed_mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return fixed_sum(x, axis, keepdims) / x.shape[axis]


# Tokens per tile in batch-invariant mode: every per-token computation then runs on
# arrays of exactly this many rows, whatever the step's token or row bucket.
INVARIANT_TILE = 8


def token_tiled(fn, *args, tile: int = INVARIANT_TILE):
    """fn(*args) computed over the leading (token) axis in fixed tiles of ``tile`` rows.

    ``args`` are pytrees of arrays sharing that leading axis. Every call of fn sees
    arrays of the same shape, whatever the token count, so a token's bits cannot
    depend on how many tokens share the step: not through a matmul's kernel choice
    (which follows the row count), nor through a vectorised loop's remainder lanes,
    nor through a reduce's loop order. fn must treat tokens independently; arrays it
    closes over are shared by every tile.

    There are always at least two tiles, and the loop's trip count is data-dependent
    as far as XLA can tell: with one tile XLA turns the tile slicing into plain
    reshapes and fuses the body differently, which changed a Sinkhorn result's bits
    (measured: one token in a 16-token step with 16-row tiles vs in a 256-token
    step). So every program runs the same loop body on the same slicing. (An
    optimization barrier would not do: XLA CPU removes them before fusing.)
    """
    n = jax.tree.leaves(args)[0].shape[0]
    n_tiles = max(-(-n // tile), 2)
    padded = n_tiles * tile

    def split(a):
        a = jnp.concatenate([a, jnp.zeros((padded - n, *a.shape[1:]), a.dtype)]) if padded != n else a
        return a.reshape(n_tiles, tile, *a.shape[1:])

    tiles = jax.tree.map(split, args)
    take = lambda i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tiles)  # noqa: E731
    shapes = jax.eval_shape(lambda: fn(*take(0)))
    init = jax.tree.map(lambda s: jnp.zeros((n_tiles, *s.shape), s.dtype), shapes)

    def body(i, out):
        return jax.tree.map(lambda o, y: jax.lax.dynamic_update_index_in_dim(o, y, i, 0), out, fn(*take(i)))

    trips = opaque_count(n_tiles, jax.tree.leaves(args)[0])
    out = jax.lax.fori_loop(0, trips, body, init)
    return jax.tree.map(lambda o: o.reshape(padded, *o.shape[2:])[:n], out)


def opaque_count(count: int, data: jax.Array) -> jax.Array:
    """``count`` (>= 1) as a value XLA cannot fold to a constant: max(count, a 0-or-1 read from data).
    A loop with this trip count is kept a loop (XLA inlines or unrolls one it can count), so
    programs of every size run the same compiled body."""
    probe = data.reshape(-1)[0]
    flag = jnp.isnan(probe) if jnp.issubdtype(probe.dtype, jnp.floating) else probe < 0
    return jnp.maximum(jnp.int32(count), flag.astype(jnp.int32))


def per_token(tiled: bool, fn, *args):
    """fn(*args) for a fn that treats the leading axis as independent tokens: in one call
    normally, in fixed tiles (token_tiled) when ``tiled`` (batch-invariant mode)."""
    return token_tiled(fn, *args) if tiled else fn(*args)


def per_token_2d(tiled: bool, fn, *args):
    """per_token for arrays with two leading token axes [B, S, ...] (the layer stack's layout)."""
    if not tiled:
        return fn(*args)
    lead = jax.tree.leaves(args)[0].shape[:2]
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), args)
    out = token_tiled(fn, *flat)
    return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)
