"""Small numeric building blocks shared by the V4 layers.

Weights are ``[out, in]`` (checkpoint layout), or on a CPU the dense projections ``[in, out]``
(weight_layout.py). Norms compute in fp32 and return
the input dtype, as the reference does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer.models.deepseek_v4.weight_layout import InOut
from deepinfer.numerics import fixed_mean


def einsum_f32(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Contraction with an fp32 result (fp32 accumulation for bf16 inputs).

    Accelerators take bf16 operands with an fp32 accumulator directly. XLA's CPU
    backend rejects some bf16 x bf16 -> f32 dots ("Unsupported element type for
    DotThunk::Execute", e.g. the batched probs @ values), and has no bf16 matmul
    units anyway, so there the operands are upcast first.
    """
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        return jnp.einsum(equation, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


def linear(x: jax.Array, w) -> jax.Array:
    """x[..., in] @ w[out, in].T -> [..., out], accumulated in fp32, returned in x's dtype. ``w`` may be
    stored transposed (an InOut, weight_layout.py: the layout a CPU's dot is fast with)."""
    if isinstance(w, InOut):
        return einsum_f32("...k,kn->...n", x, w.t.astype(x.dtype)).astype(x.dtype)
    return einsum_f32("...k,nk->...n", x, w.astype(x.dtype)).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Weighted RMSNorm over the last axis; the (fp32) weight multiplies in fp32."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(fixed_mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight (per-head query norm, hyper-connection input norm)."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(fixed_mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """V4's clamped SwiGLU: gate clipped from above, up clipped on both sides."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up
