"""Save and restore the parameter tree with orbax, onto any device layout.

A checkpoint directory holds:

* ``config.json`` — the ModelConfig in the transformers spelling;
* ``params/`` — the parameter tree, written by orbax (tensorstore, OCDBT); each
  array is stored once, whatever the layout it was saved from, so a restore can
  ask for any sharding and orbax reads only each device's slice;
* ``deepinfer_checkpoint.json`` — the manifest (deepinfer/orbax_manifest.py),
  written *last*: its presence means the params are durable, so a save that died
  half-way is never taken for a checkpoint;
* tokenizer files copied from the source checkpoint, when given.

Restoring builds the abstract target from the manifest (checked against the
config's parameter tree first), so no weight is read before the checkpoint is
known to fit, and ``mtp="skip"`` restores a partial tree: the MTP arrays are not
read at all.

``dtype`` on load casts the model-dtype floating leaves (orbax casts on the host
while reading, so a float32 checkpoint loads as bfloat16 without a float32 copy
on device); the float32 / int32 leaves the model pins are restored as saved, and
quantized weights keep their bytes (only the dtype they stand for changes).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.models.deepseek_v4.loader import CheckpointError
from deepinfer.models.deepseek_v4.param_tree import model_spec
from deepinfer.orbax_manifest import (  # noqa: F401  (MANIFEST, is_orbax_checkpoint: part of this API)
    MANIFEST,
    abstract_leaf,
    check_against_spec,
    check_against_stored,
    check_header,
    describe,
    is_orbax_checkpoint,
    manifest_arrays,
    stored_arrays,
)
from deepinfer.params import flatten_dotted, unflatten_dotted

PARAMS = "params"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")

Shardings = Callable[[str, tuple[int, ...], Any], jax.sharding.Sharding] | Mapping[str, Any]


def copy_tokenizer_files(source_dir: str | os.PathLike, directory: str | os.PathLike) -> list[str]:
    """Copy whichever tokenizer files ``source_dir`` has; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(source_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(directory, name))
            copied.append(name)
    return copied


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PendingSave:
    """A save whose arrays are still being written; ``wait()`` blocks until it is durable.

    Orbax copies every array to host memory before ``save_orbax`` returns, so the
    caller may drop or donate its arrays at once; the files are written by a
    background thread. ``wait()`` joins it (re-raising its error), then writes the
    manifest that marks the checkpoint complete. It is idempotent.
    """

    def __init__(self, checkpointer: ocp.AsyncCheckpointer, manifest_path: str, manifest: dict):
        self._checkpointer, self._manifest_path, self._manifest = checkpointer, manifest_path, manifest

    @property
    def done(self) -> bool:
        return self._checkpointer is None

    def wait(self) -> None:
        if self._checkpointer is None:
            return
        checkpointer, self._checkpointer = self._checkpointer, None
        try:
            checkpointer.wait_until_finished()
        finally:
            checkpointer.close()
        _write_json_atomic(self._manifest_path, self._manifest)


def save_orbax(
    directory: str | os.PathLike, cfg: ModelConfig, params: Any, *, wait: bool = True, source_dir: str | os.PathLike | None = None
) -> PendingSave:
    """Write ``config.json``, the orbax ``params`` folder and the manifest into ``directory``.

    ``wait=False`` returns as soon as the arrays are on the host; call ``.wait()``
    on the result before relying on the checkpoint (until then there is no manifest).
    """
    directory = os.fspath(directory)
    params_dir = os.path.join(directory, PARAMS)
    if os.path.exists(params_dir):
        raise FileExistsError(f"{params_dir} already exists; save into a new directory")
    manifest = describe(params)  # before anything is written: a leaf that is not an array fails here
    os.makedirs(directory, exist_ok=True)
    manifest_path = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest_path):  # a stale manifest must not vouch for the new, unfinished params
        os.remove(manifest_path)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    if source_dir is not None:
        copy_tokenizer_files(source_dir, directory)
    checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
    try:
        checkpointer.save(os.path.abspath(params_dir), args=ocp.args.PyTreeSave(params))
    except BaseException:
        checkpointer.close()
        raise
    pending = PendingSave(checkpointer, manifest_path, manifest)
    if wait:
        pending.wait()
    return pending


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory}: not a deepinfer orbax checkpoint (no {MANIFEST}; an unfinished save has none)")
    try:
        with open(path, encoding="utf-8") as f:
            return check_header(json.load(f), path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _sharding_fn(shardings: Shardings | None) -> Callable[[str, tuple[int, ...], Any], Any]:
    """One callable ``(path, shape, dtype) -> Sharding`` from whichever form the caller gave."""
    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda path, shape, dtype: default
    if callable(shardings):
        return shardings
    # A flat {path: Sharding} dict, or a nested tree like sharding.rules.param_shardings' output.
    flat = flatten_dotted(shardings)

    def lookup(path, shape, dtype):
        if path not in flat:
            raise ValueError(f"shardings has no entry for parameter {path}")
        return flat[path]

    return lookup


def _target(cfg: ModelConfig, leaves: dict, include_mtp: bool, dtype: Any, shardings: Shardings | None) -> Any:
    """The abstract tree to restore onto: the spec's structure, the manifest's arrays, the caller's shardings."""
    sharding_of = _sharding_fn(shardings)
    spec_tree = model_spec(cfg, include_mtp=include_mtp)
    values = {
        path: abstract_leaf(leaves[path], spec, dtype, lambda shape, dt, path=path: sharding_of(path, shape, dt))
        for path, spec in flatten_dotted(spec_tree).items()
    }
    return unflatten_dotted(spec_tree, values)


def _restore(params_dir: str, target: Any, expected: dict, partial: bool) -> Any:
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        try:
            metadata = checkpointer.metadata(params_dir).item_metadata
        except Exception as e:  # orbax raises many types for a damaged folder; all mean the same here
            raise CheckpointError(f"{params_dir}: unreadable or truncated orbax checkpoint ({_first_line(e)})") from e
        if metadata is None:  # orbax logs why and returns nothing when its metadata cannot be read
            raise CheckpointError(f"{params_dir}: unreadable or truncated orbax checkpoint (its array metadata cannot be read)")
        stored = stored_arrays(metadata.tree)
        check_against_stored(expected, stored, params_dir)
        try:
            args = ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial
            )
            return checkpointer.restore(params_dir, args=args)
        except Exception as e:
            raise CheckpointError(f"{params_dir}: unreadable or truncated orbax checkpoint ({_first_line(e)})") from e
    finally:
        checkpointer.close()


def _first_line(e: BaseException) -> str:
    """The innermost cause's first line: tensorstore's own error names the array and the byte range."""
    seen = {id(e)}
    while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) not in seen:
        e = e.__cause__ or e.__context__
        seen.add(id(e))
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def load_orbax(
    directory: str | os.PathLike,
    *,
    dtype: Any = None,
    shardings: Shardings | None = None,
    mtp: str = "auto",
    progress=None,
) -> tuple[ModelConfig, Any]:
    """(config, params) from a :func:`save_orbax` directory, placed by ``shardings``.

    ``shardings``: ``(dotted_path, shape, dtype) -> Sharding`` or ``{dotted_path:
    Sharding}`` (a nested tree of them works too), giving each weight's sharding; a
    quantized weight's data and scale follow it (weight_placement.part_sharding).
    None: every array on the first device. ``dtype``: see the module docstring.
    ``mtp``: "auto" restores MTP blocks when saved, "skip" leaves them unread,
    "require" fails without them. ``progress`` (deepinfer/load_progress.py) is told the
    totals, then everything at once when the restore returns (orbax reads all arrays
    concurrently, in one call).
    """
    if mtp not in ("auto", "require", "skip"):
        raise ValueError(f"mtp must be 'auto', 'require' or 'skip', got {mtp!r}")
    directory = os.fspath(directory)
    leaves = _read_manifest(directory)
    try:
        cfg = ModelConfig.from_json_file(directory)
    except (OSError, ConfigError) as e:
        raise CheckpointError(f"{directory}: cannot read config.json ({e})") from None
    params_dir = os.path.abspath(os.path.join(directory, PARAMS))
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{directory}: the manifest is there but the {PARAMS}/ folder is missing")
    has_mtp = any(p.startswith("mtp.") for p in leaves)
    if mtp == "require" and cfg.num_nextn_predict_layers and not has_mtp:
        raise CheckpointError(f"{directory}: the checkpoint has no MTP weights (mtp.*); load with mtp='auto' to run without MTP")
    check_against_spec(leaves, flatten_dotted(model_spec(cfg, include_mtp=has_mtp)), directory)
    include_mtp = has_mtp and mtp != "skip"
    target = _target(cfg, leaves, include_mtp, dtype, shardings)
    paths = list(flatten_dotted(target))
    nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(target))
    if progress is not None:
        progress.start(len(paths), nbytes)
    params = _restore(params_dir, target, manifest_arrays(leaves, paths), partial=has_mtp and not include_mtp)
    if progress is not None:
        progress.advance(len(paths), nbytes)
    return cfg, params
