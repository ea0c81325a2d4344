"""The dense projections' storage layout on the platform that runs them.

The parameter tree keeps the checkpoint's ``[out, in]`` matrices (param_tree.py): loading, sharding
rules, quantized leaves and writing back all speak that layout. On a CPU, though, XLA's dot for a
few rows against an ``[out, in]`` weight goes through a path 1.5-2x slower than against the same
weight stored ``[in, out]`` (jitted einsums, jax 0.10.2: 2 rows x 1024 x 256, 40 against 24 us; 2
rows through a 4096 x 256 lm head, 119 against 64 us; one row costs the same either way; no XLA CPU
flag changed that), and asking XLA for a column-major parameter layout instead (``jax.experimental.
layout``) made the same dot 3-10x slower. So on a CPU the engine stores the dense projections
transposed, once, when it places the weights, each as an :class:`InOut` leaf that ``ops.linear`` and
the lm head read as ``[in, out]``; ``generate()`` does the same to the params it is given (engine
params pass through unchanged). BENCHMARKS.md §5 has the step times (8-20 % off 1-8-token steps).
Routed experts stay stacked ``[E, out, in]`` (decode runs them a row at a time, where both layouts
cost the same, and the grouped kernels take that layout); weights kept quantized stay as stored
(they are dequantized inside the step anyway).

On other platforms the tree is returned as it is (not measured there: a GPU's GEMMs take a
transposed operand natively). A tree holding InOut leaves is a compute tree: placement on a mesh
and the checkpoint writers read the loader's ``[out, in]`` tree (``checkpoint_layout`` gives it
back; an engine handed another engine's params does that before placing them).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.quant.formats import is_quantized

# leaves read only through ops.linear (attention, compressors, indexer, MTP projections), by name
_PROJECTIONS = frozenset({"wq_a", "wq_b", "wkv", "wo_b", "wgate", "weights_proj", "e_proj", "h_proj"})


@jax.tree_util.register_pytree_with_keys_class
class InOut:
    """A dense ``[out, in]`` weight stored transposed: ``t`` is ``[in, out]``."""

    def __init__(self, t: Any):
        self.t = t

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``[out, in]`` shape (what the weight stands for)."""
        return tuple(self.t.shape[::-1])

    @property
    def dtype(self):
        return self.t.dtype

    def __repr__(self) -> str:
        return f"InOut(shape={self.shape}, dtype={self.dtype})"

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("t"), self.t),), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


def is_projection(path: tuple[str, ...]) -> bool:
    """Whether the leaf at ``path`` (dict keys) is a dense projection read only by ``linear`` / the lm head."""
    name = path[-1]
    parent = path[-2] if len(path) > 1 else None
    return (name in _PROJECTIONS or (parent == "gate" and name == "weight")
            or (parent == "shared" and name in ("w1", "w2", "w3")) or path == ("head",))


def _transposed(w: jax.Array) -> jax.Array:
    """The 2-D ``w`` transposed on the same devices, its sharding's axes swapped."""
    sharding = w.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[::-1]))
    if w.is_fully_addressable:
        # on a CPU the device memory is the host's: a numpy transpose, no program to compile. An
        # uncommitted weight stays uncommitted: a committed argument is another jit cache entry than the
        # program warm-up compiled ahead for (runtime/ahead_of_time.abstract), so each would compile twice
        return jax.device_put(np.ascontiguousarray(np.asarray(w).T), sharding if w.committed else None)
    # several processes (each holds its own devices' shards): transposed where it lies
    return jax.jit(_transpose, out_shardings=sharding)(w)


def _transpose(a: jax.Array) -> jax.Array:
    """(one function object, so the jitted transposes of equal shapes compile once)"""
    return a.T


def for_platform(params: dict, platform: str) -> dict:
    """``params`` with every dense projection stored ``[in, out]`` (InOut) when ``platform`` is "cpu";
    unchanged otherwise, or when already laid out. Leaves that are not plain 2-D float arrays
    (quantized, already InOut) are left alone."""
    if platform != "cpu":
        return params

    def lay(path, leaf):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        if not (isinstance(leaf, (jax.Array, np.ndarray)) and leaf.ndim == 2 and jnp.issubdtype(leaf.dtype, jnp.floating)
                and is_projection(keys)):
            return leaf
        return InOut(_transposed(leaf if isinstance(leaf, jax.Array) else jax.device_put(leaf)))

    return jax.tree_util.tree_map_with_path(lay, params, is_leaf=lambda x: isinstance(x, InOut) or is_quantized(x))


def is_laid_out(params: Any) -> bool:
    """Whether any weight of ``params`` is stored transposed (InOut)."""
    return any(isinstance(x, InOut) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, InOut)))


def checkpoint_layout(params: Any) -> Any:
    """The inverse of :func:`for_platform`: every InOut back to the plain ``[out, in]`` array (e.g. an
    engine's params handed to another engine, whose placement reads the checkpoint's tree)."""
    if not is_laid_out(params):
        return params
    return jax.tree.map(lambda x: _transposed(x.t) if isinstance(x, InOut) else x, params,
                        is_leaf=lambda x: isinstance(x, InOut))
