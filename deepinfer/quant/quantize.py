"""Quantizing float weights into the release's layout (test checkpoints, ``deepinfer.convert``).

No real release can be downloaded on the project's machines, so the tests build
official-format checkpoints from random tiny configs with these functions. They
follow the release's recipe: a block's scale is its absolute maximum over the
format's largest finite value (448 for e4m3, 6 for e2m1), rounded *up* to a power
of two for ue8m0 so that no value overflows; values round to nearest-even.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer.quant.formats import FP4_GROUP, FP8_BLOCK, QuantizedArray, expand_scales

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK_SHAPE = (128, 128)
FP4_GROUP_SHAPE = (1, 32)


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = w.shape[-2:]
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = np.zeros((*w.shape[:-2], nr * br, nc * bc), np.float32)
    padded[..., :rows, :cols] = np.abs(w)
    return padded.reshape(*w.shape[:-2], nr, br, nc, bc).max(axis=(-3, -1))


def _scales(amax: np.ndarray, fmt_max: float, scale_fmt: str) -> np.ndarray:
    s = np.maximum(amax, np.float32(1e-30)) / np.float32(fmt_max)
    if scale_fmt == "ue8m0":
        return np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    if scale_fmt == "float":
        return s.astype(np.float32)
    raise ValueError(f"scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")


def _stored_scales(s: np.ndarray, scale_fmt: str) -> np.ndarray:
    return s.astype(ml_dtypes.float8_e8m0fnu) if scale_fmt == "ue8m0" else s


def quantize_fp8_block(w: np.ndarray, scale_fmt: str = "ue8m0", block=FP8_BLOCK_SHAPE) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weight, scales) for a float ``[..., out, in]`` weight."""
    w = np.asarray(w, np.float32)
    s = _scales(_block_amax(w, block), E4M3_MAX, scale_fmt)
    q = np.clip(w / expand_scales(s, *w.shape[-2:], block), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, _stored_scales(s, scale_fmt)


def quantize_fp4_group(w: np.ndarray, scale_fmt: str = "ue8m0", group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(packed e2m1 int8 weight ``[..., out, in/2]``, scales ``[..., out, in/group]``)."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % group:
        raise ValueError(f"FP4 needs the input dimension ({w.shape[-1]}) to be a multiple of {group}")
    block = (1, group)
    s = _scales(_block_amax(w, block), E2M1_MAX, scale_fmt)
    codes = (np.clip(w / expand_scales(s, *w.shape[-2:], block), -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn)).view(np.uint8)
    codes = codes & 0xF
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, _stored_scales(s, scale_fmt)


# Which release tensors are FP8: the attention and shared-expert linears. The
# compressors' and the indexer's kv / gate / weights projections ship in bf16
# (transformers keeps them out of its FP8 conversion for DeepSeek-V4-Flash), as do
# the embedding, the head, the router and everything that is not a matrix.
_FP8_LEAVES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared.w1", "ffn.shared.w2", "ffn.shared.w3", "e_proj", "h_proj")


def release_format(path: str) -> str | None:
    """The format the release stores a tree path in: FP8_BLOCK, FP4_GROUP or None (unquantized)."""
    if ".ffn.experts." in path:
        return FP4_GROUP
    return FP8_BLOCK if path.endswith(_FP8_LEAVES) else None


def quantize_like_release(params: dict, scale_fmt: str = "ue8m0", dtype: Any = None) -> dict:
    """The tree with each weight the release quantizes replaced by a QuantizedArray in its format.

    Writing the result with ``save_official`` gives a checkpoint in the release's layout.
    """
    from deepinfer.params import flatten_dotted, unflatten_dotted

    out = {}
    for path, value in flatten_dotted(params).items():
        kind = release_format(path)
        if kind is None:
            out[path] = value
            continue
        w = np.asarray(value, np.float32)
        if kind == FP8_BLOCK:
            q, s = quantize_fp8_block(w, scale_fmt)
            data, block = q, FP8_BLOCK_SHAPE
        else:
            q, s = quantize_fp4_group(w, scale_fmt)
            data, block = q.view(np.uint8), FP4_GROUP_SHAPE
        s = np.asarray(s).view(np.uint8) if scale_fmt == "ue8m0" else s
        out[path] = QuantizedArray(jnp.asarray(data), jnp.asarray(s), kind, block, dtype or np.asarray(value).dtype)
    return unflatten_dotted(params, out)
