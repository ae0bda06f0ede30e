"""Elementwise pieces shared by the decoder (`forward`) and the MoE block (`moe`), and `opaque`."""

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


def opaque(predicate: jax.Array, fn, *operands):
    """fn(*operands), computed where XLA cannot see through it: inside a conditional whose two
    branches are both `fn`, on a traced `predicate` whose value therefore does not matter (a constant
    one would let XLA inline the conditional). The result is a buffer of its own, which consumers
    read instead of recomputing `fn` inside their fusions (XLA:CPU drops optimization barriers
    before fusion, so a barrier cannot do this). Used where that fusion costs more than the buffer:
    RoPE tables shared by every layer, and cache rows read out of a donated cache that is updated
    in place afterwards (gemmax.model.kv_cache.KVCache.rows)."""
    return jax.lax.cond(predicate, fn, fn, *operands)
