"""Abstract parameter trees: every weight described once.

A model describes its weights as a pytree (nested dicts / lists) whose leaves are
:class:`ParamSpec` — shape, dtype policy, logical axis names and an initializer.
From that one tree derive:

* :func:`init_params` — random weights (tiny test models, benchmarks);
* :func:`abstract_params` — ``jax.ShapeDtypeStruct`` targets for the loader;
* :func:`logical_axes` — axis names that ``sharding/`` maps to mesh axes.

Leaves are plain arrays at step time (flat leaves into one jit, no module state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.quant.formats import QuantizedArray

# dtype policies: the model's compute dtype, or pinned regardless of it.
MODEL_DTYPE = "model"
FLOAT32 = "float32"
INT32 = "int32"


@dataclass(frozen=True)
class ParamSpec:
    """One weight. ``axes`` has one logical name (or None) per dimension.

    ``init`` is one of "normal" (std ``scale``), "zeros", "ones", or
    "expert_table" (int table of ``shape[-1]`` distinct expert ids per row, below
    ``high``).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    dtype: str = MODEL_DTYPE
    scale: float = 0.02
    high: int = 0

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec shape {self.shape} and axes {self.axes} differ in rank")

    def resolve_dtype(self, model_dtype: Any) -> jnp.dtype:
        return {MODEL_DTYPE: jnp.dtype(model_dtype), FLOAT32: jnp.dtype(jnp.float32), INT32: jnp.dtype(jnp.int32)}[
            self.dtype
        ]


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def is_param_leaf(x: Any) -> bool:
    """A spec, or a weight kept quantized (one parameter, though a pytree of data and scales)."""
    return isinstance(x, (ParamSpec, QuantizedArray))


def map_specs(fn: Callable[[ParamSpec], Any], tree: Any) -> Any:
    return jax.tree.map(fn, tree, is_leaf=is_spec)


def abstract_params(tree: Any, dtype: Any) -> Any:
    """ShapeDtypeStruct per leaf: what a checkpoint must provide."""
    return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, s.resolve_dtype(dtype)), tree)


def logical_axes(tree: Any) -> Any:
    return map_specs(lambda s: s.axes, tree)


def count_params(tree: Any) -> int:
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(tree, is_leaf=is_spec))


def _init_leaf(spec: ParamSpec, key: jax.Array, dtype: Any) -> jax.Array:
    out_dtype = spec.resolve_dtype(dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, out_dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, out_dtype)
    if spec.init == "normal":
        return (spec.scale * jax.random.normal(key, spec.shape, jnp.float32)).astype(out_dtype)
    if spec.init == "expert_table":
        # Each row: k distinct experts, the first k of a random permutation.
        rows, k = spec.shape
        noise = jax.random.uniform(key, (rows, spec.high))
        return jnp.argsort(noise, axis=-1)[:, :k].astype(out_dtype)
    raise ValueError(f"unknown initializer {spec.init!r}")


def init_params(tree: Any, key: jax.Array, dtype: Any = jnp.float32) -> Any:
    """Random weights for every leaf, each from a key folded with its path (stable under edits elsewhere)."""
    flat = flatten_dotted(tree)
    return unflatten_dotted(
        tree, {path: _init_leaf(spec, jax.random.fold_in(key, _stable_hash(path)), dtype) for path, spec in flat.items()}
    )


def dotted_name(key_path: tuple, attributes: bool = False) -> str:
    """"layers.0.attn.wq_a" for a jax key path; with ``attributes``, a QuantizedArray's parts too
    ("...experts.w1.data", as orbax names the arrays it stores)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif attributes and isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            raise TypeError(f"unsupported tree key {k!r}")
    return ".".join(parts)


def flatten_dotted(tree: Any) -> dict[str, Any]:
    """{"layers.0.attn.wq_a": leaf, ...} in tree order (ParamSpecs and QuantizedArrays count as leaves)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_param_leaf)
    return {dotted_name(path): leaf for path, leaf in leaves}


def unflatten_dotted(like: Any, values: dict[str, Any]) -> Any:
    """Rebuild a tree shaped like ``like`` from dotted-path values (every path must be present)."""
    paths = list(flatten_dotted(like))
    return jax.tree.unflatten(jax.tree.structure(like, is_leaf=is_param_leaf), [values[p] for p in paths])


def _stable_hash(text: str) -> int:
    """A process-independent 31-bit hash (Python's hash() is salted per process)."""
    h = 2166136261
    for byte in text.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h & 0x7FFFFFFF
