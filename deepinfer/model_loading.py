"""Load a model folder, whichever format it is in: safetensors (HF / official, FP8 / FP4 too) or orbax.

One entry point for ``LLM()``, the server and ``deepinfer.convert``, so every
surface accepts the same folders and gives the same errors.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.quant.formats import dequantize_tree

QUANTIZED_WEIGHTS = ("dequantize", "keep")


def load_model(
    directory: str | os.PathLike,
    *,
    dtype: Any = "float32",
    mtp: str = "auto",
    quantized_weights: str = "dequantize",
    shardings: Mapping[str, Any] | None = None,
    shardings_for: Callable[[ModelConfig], Mapping[str, Any] | None] | None = None,
    progress=None,
) -> tuple[ModelConfig, dict]:
    """(config, params) from a checkpoint folder. ``quantized_weights``: FP8 / FP4 weights are
    dequantized to ``dtype`` at load ("dequantize") or kept in their stored format ("keep").
    ``shardings`` ({tree path: Sharding}) places each weight as it is read; ``shardings_for`` makes
    them from the folder's config (the engine's parallel layout: runtime/mesh_setup.load_shardings)."""
    if quantized_weights not in QUANTIZED_WEIGHTS:
        raise ValueError(f"quantized_weights must be one of {QUANTIZED_WEIGHTS}, got {quantized_weights!r}")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: no such checkpoint folder")
    from deepinfer.orbax_manifest import is_orbax_checkpoint

    if shardings_for is not None and shardings is None:
        try:
            cfg = ModelConfig.from_json_file(directory)
        except (OSError, ConfigError):  # the loader below reports a bad or missing config.json itself
            cfg = None
        shardings = shardings_for(cfg) if cfg is not None else None

    if is_orbax_checkpoint(directory):
        from deepinfer.orbax_io import load_orbax

        cfg, params = load_orbax(directory, dtype=dtype, shardings=shardings, mtp=mtp, progress=progress)
        return cfg, dequantize_tree(params) if quantized_weights == "dequantize" else params
    from deepinfer.models.deepseek_v4.loader import load_checkpoint

    return load_checkpoint(
        directory, dtype=dtype, mtp=mtp, progress=progress, quantized_weights=quantized_weights, shardings=shardings
    )
