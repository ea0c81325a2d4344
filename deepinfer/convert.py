"""`python -m deepinfer.convert SRC DST`: safetensors checkpoint <-> orbax checkpoint.

SRC is a safetensors checkpoint folder (config.json + *.safetensors, transformers
or official naming) or an orbax folder written by deepinfer (it has
deepinfer_checkpoint.json). DST is written in the other format unless --to says
otherwise: orbax via deepinfer.orbax_io.save_orbax, safetensors with the official
release's names via the loader's save_official. Tokenizer files are copied.

--dtype casts the model-dtype weights (default: a safetensors source keeps the
dtype its embedding is stored in; an orbax source keeps its saved dtype).
--quantized-weights: for a safetensors source it is handed to the loader; for an
orbax source "dequantize" turns quantized weights into plain ones and "keep"
(the default) writes them as stored.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

ORBAX, SAFETENSORS = "orbax", "safetensors"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deepinfer.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="checkpoint folder to read (safetensors or orbax)")
    p.add_argument("dst", metavar="DST", help="folder to write (must not already hold a checkpoint)")
    p.add_argument("--to", choices=(ORBAX, SAFETENSORS), help="output format (default: the other one than SRC's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="model dtype to write (default: the source's)")
    p.add_argument("--quantized-weights", choices=("keep", "dequantize"),
                   help="FP8/FP4 weights: keep them as stored (the default: lossless) or dequantize to --dtype")
    return p.parse_args(argv)


def source_format(src: str) -> str:
    """ORBAX or SAFETENSORS, from what the folder holds; a ValueError saying why for anything else."""
    from deepinfer.orbax_io import is_orbax_checkpoint

    if not os.path.isdir(src):
        raise ValueError(f"{src}: no such checkpoint folder")
    if is_orbax_checkpoint(src):
        return ORBAX
    if any(name.endswith(".safetensors") for name in os.listdir(src)):
        return SAFETENSORS
    raise ValueError(f"{src}: not a checkpoint folder (no deepinfer_checkpoint.json and no *.safetensors file)")


def _stored_model_dtype(src: str) -> str:
    """The dtype the embedding is stored in: the model dtype of a safetensors checkpoint
    (the embedding is never quantized and has the model's dtype policy)."""
    from deepinfer.models.deepseek_v4.weight_names import resolve
    from deepinfer.safetensors_io import open_checkpoint_files

    for f in open_checkpoint_files(src):
        for name in f.keys():
            ref = resolve(name)
            if ref is not None and ref.path == "embed":
                return "bfloat16" if f.dtype(name).name == "bfloat16" else "float32"
    return "float32"


def _load(src: str, fmt: str, args: argparse.Namespace):
    from deepinfer.model_loading import load_model

    # the source's dtype unless asked; FP8/FP4 kept unless asked: a conversion is lossless by default
    dtype = args.dtype or (None if fmt == ORBAX else _stored_model_dtype(src))
    return load_model(src, dtype=dtype, mtp="auto", quantized_weights=args.quantized_weights or "keep")


def _save(dst: str, fmt: str, cfg, params, src: str) -> None:
    from deepinfer.orbax_io import copy_tokenizer_files, save_orbax

    if fmt == ORBAX:
        save_orbax(dst, cfg, params, source_dir=src)
        return
    from deepinfer.models.deepseek_v4.loader import save_official

    if os.path.exists(os.path.join(dst, "model.safetensors")):
        raise FileExistsError(f"{dst} already holds model.safetensors; convert into a new folder")
    save_official(cfg, params, dst)
    copy_tokenizer_files(src, dst)


def _sizes(params: Any) -> tuple[int, int, int]:
    """(parameters, arrays, bytes): a quantized weight is one parameter of two arrays."""
    import jax

    from deepinfer.params import flatten_dotted

    arrays = jax.tree.leaves(params)
    return len(flatten_dotted(params)), len(arrays), sum(int(a.size) * a.dtype.itemsize for a in arrays)


def convert(src: str, dst: str, args: argparse.Namespace) -> str:
    """Do the conversion; returns the one-line summary."""
    fmt_in = source_format(src)
    fmt_out = args.to or (SAFETENSORS if fmt_in == ORBAX else ORBAX)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("SRC and DST are the same folder")
    start = time.perf_counter()
    cfg, params = _load(src, fmt_in, args)
    loaded = time.perf_counter()
    _save(dst, fmt_out, cfg, params, src)
    done = time.perf_counter()
    n_params, n_arrays, nbytes = _sizes(params)
    return (f"converted {src} ({fmt_in}) -> {dst} ({fmt_out}): {n_params} tensors ({n_arrays} arrays), "
            f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB) in {done - start:.2f}s "
            f"(load {loaded - start:.2f}s, save {done - loaded:.2f}s)")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # orbax logs through absl; its warnings would add lines to the one-line error.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        print(convert(args.src, args.dst, args))
    except Exception as e:  # a CLI: every failure is one line naming the problem, no traceback
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {text}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
