"""Elementwise pieces shared by the decoder (`forward`) and the MoE block (`moe`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """x * (mean(x^2) + eps)^-1/2 * w, in float32, cast back to x's dtype ([..., D], w [D])."""
    xf = x.astype(jnp.float32)
    y = xf * jnp.power(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)
