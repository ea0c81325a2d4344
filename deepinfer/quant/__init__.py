"""Block-scaled FP8 / FP4 weights: the official format, quantizers, in-memory dequantization."""

from deepinfer.quant.formats import (
    FP4_GROUP,
    FP8_BLOCK,
    QuantizedArray,
    dequantize_np,
    is_quantized,
)

__all__ = ["FP4_GROUP", "FP8_BLOCK", "QuantizedArray", "dequantize_np", "is_quantized"]
