"""The manifest of an orbax checkpoint: what every parameter is, checked before any byte is read.

``deepinfer_checkpoint.json`` next to the orbax ``params`` folder lists each
parameter by dotted path: a plain array's shape and dtype, or a
:class:`QuantizedArray`'s kind, block, dtype and its data / scale arrays. The
loader checks it against the config's parameter tree and builds the abstract
restore target from it, so a checkpoint that does not fit the model is refused
naming the parameters, instead of failing deep inside orbax (or, worse,
restoring an array of the wrong shape).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer.models.deepseek_v4.loader import CheckpointError
from deepinfer.params import MODEL_DTYPE, ParamSpec, dotted_name, flatten_dotted
from deepinfer.quant.formats import KINDS, QuantizedArray, logical_shape
from deepinfer.weight_placement import part_sharding

FORMAT = "deepinfer-orbax"
VERSION = 1
MANIFEST = "deepinfer_checkpoint.json"  # beside the orbax tree; written last, so it marks a finished save
_MAX_LISTED = 12


def is_orbax_checkpoint(directory: str | os.PathLike) -> bool:
    """Here rather than in orbax_io so that telling the formats apart does not import orbax."""
    return os.path.isfile(os.path.join(os.fspath(directory), MANIFEST))


def listing(kind: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{kind} ({len(items)}): {shown}{more}"


def _array_entry(x: Any) -> dict[str, Any]:
    return {"shape": [int(d) for d in np.shape(x)], "dtype": jnp.dtype(x.dtype).name}


def describe(params: Any) -> dict[str, Any]:
    """The manifest of a parameter tree (reads shapes and dtypes only, never the values)."""
    leaves: dict[str, Any] = {}
    for path, leaf in flatten_dotted(params).items():
        if isinstance(leaf, QuantizedArray):
            leaves[path] = {
                "kind": leaf.kind,
                "block": list(leaf.block),
                "dtype": leaf.dtype.name,
                "data": _array_entry(leaf.data),
                "scale": _array_entry(leaf.scale),
            }
        else:
            leaves[path] = _array_entry(leaf)
    return {"format": FORMAT, "version": VERSION, "leaves": leaves}


def check_header(manifest: Any, where: str) -> dict[str, Any]:
    """The manifest's leaves, after checking it is one this code can read."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{where}: manifest version {manifest.get('version')!r}; this deepinfer reads version {VERSION}")
    leaves = manifest.get("leaves")
    if not isinstance(leaves, dict) or not leaves:
        raise CheckpointError(f"{where}: the manifest lists no parameters")
    return leaves


def is_quantized_entry(entry: Mapping[str, Any]) -> bool:
    return "kind" in entry


def entry_shape(entry: Mapping[str, Any]) -> tuple[int, ...]:
    """The logical shape of the weight an entry stands for (an FP4 weight's data holds two values a byte)."""
    if is_quantized_entry(entry):
        return logical_shape(entry["kind"], tuple(entry["data"]["shape"]))
    return tuple(entry["shape"])


def check_against_spec(leaves: Mapping[str, Any], specs: Mapping[str, ParamSpec], where: str) -> None:
    """Every problem at once, naming the parameters: missing, unexpected, mis-shaped, wrong pinned dtype."""
    missing = [p for p in specs if p not in leaves]
    unexpected = [p for p in leaves if p not in specs]
    wrong: list[str] = []
    for path, spec in specs.items():
        entry = leaves.get(path)
        if entry is None:
            continue
        try:
            shape = entry_shape(entry)
        except (KeyError, TypeError) as e:
            wrong.append(f"{path} (malformed manifest entry: {e!r})")
            continue
        if is_quantized_entry(entry) and entry["kind"] not in KINDS:
            wrong.append(f"{path} (unknown quantized kind {entry['kind']!r})")
        elif shape != spec.shape:
            wrong.append(f"{path} (saved {shape}, config expects {spec.shape})")
        elif spec.dtype != MODEL_DTYPE and (is_quantized_entry(entry) or entry["dtype"] != spec.dtype):
            saved = entry["kind"] if is_quantized_entry(entry) else entry["dtype"]
            wrong.append(f"{path} (saved {saved}, must be {spec.dtype})")
    problems = [listing(k, v) for k, v in (("missing", missing), ("unexpected", unexpected), ("mismatched", wrong)) if v]
    if problems:
        raise CheckpointError(f"{where} does not match its config.json: " + "; ".join(problems))


def restore_dtype(entry: Mapping[str, Any], spec: ParamSpec, dtype: Any) -> jnp.dtype:
    """What a plain leaf restores as: ``dtype`` for the model-dtype floating leaves, else as saved.

    The float32 / int32 leaves (norms, hyper-connection mixes, expert tables) are
    pinned by the model whatever its compute dtype, so a cast never touches them.
    """
    saved = jnp.dtype(entry["dtype"])
    if dtype is not None and spec.dtype == MODEL_DTYPE and jnp.issubdtype(saved, jnp.floating):
        return jnp.dtype(dtype)
    return saved


def abstract_leaf(entry: Mapping[str, Any], spec: ParamSpec, dtype: Any, sharding: Any) -> Any:
    """The restore target of one parameter: a ShapeDtypeStruct, or a QuantizedArray of two.

    ``sharding(shape, dtype)`` gives the weight's sharding (None: the default device).
    """
    if not is_quantized_entry(entry):
        shape, out = tuple(entry["shape"]), restore_dtype(entry, spec, dtype)
        return jax.ShapeDtypeStruct(shape, out, sharding=sharding(shape, out))
    # The bytes and scales restore as stored; only the dtype the weight stands for changes.
    stands_for = jnp.dtype(dtype) if dtype is not None else jnp.dtype(entry["dtype"])
    weight = sharding(entry_shape(entry), stands_for)
    parts = []
    for name in ("data", "scale"):
        shape = tuple(entry[name]["shape"])
        parts.append(jax.ShapeDtypeStruct(shape, jnp.dtype(entry[name]["dtype"]), sharding=part_sharding(weight, shape)))
    return QuantizedArray.tree_unflatten((entry["kind"], tuple(entry["block"]), stands_for.name), parts)


def keyed_name(key_path: tuple) -> str:
    """A dotted name for a jax key path, QuantizedArray parts included (``...w1.data``), as orbax names arrays."""
    return dotted_name(key_path, attributes=True)


def stored_arrays(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{orbax array name: (shape, dtype)} of orbax's own metadata tree."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {keyed_name(p): (tuple(int(d) for d in x.shape), jnp.dtype(x.dtype).name) for p, x in leaves}


def manifest_arrays(leaves: Mapping[str, Any], paths: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{orbax array name: (shape, dtype)} the manifest promises for ``paths``, as saved (before any cast)."""
    out = {}
    for path in paths:
        entry = leaves[path]
        parts = {f"{path}.{n}": entry[n] for n in ("data", "scale")} if is_quantized_entry(entry) else {path: entry}
        for name, e in parts.items():
            out[name] = (tuple(e["shape"]), e["dtype"])
    return out


def check_against_stored(expected: Mapping[str, Any], stored: Mapping[str, Any], where: str) -> None:
    """The orbax folder holds every array the manifest promises, with the saved shape and dtype.

    Compared before restoring so that a manifest and a params folder from
    different saves are refused naming the arrays, not by orbax's tree diff.
    """
    missing = [n for n in expected if n not in stored]
    wrong = [f"{n} (stored {stored[n][0]} {stored[n][1]}, manifest {e[0]} {e[1]})" for n, e in expected.items() if n in stored and stored[n] != e]
    problems = [listing(k, v) for k, v in (("missing", missing), ("mismatched", wrong)) if v]
    if problems:
        raise CheckpointError(f"{where}: the orbax arrays do not match the manifest: " + "; ".join(problems))
