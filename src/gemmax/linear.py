"""The two weight reads of the model: `linear` (x @ W.T) and `lookup` (table rows by id).

Every matrix product and every embedding gather in the model goes through these, so a weight's
stored form (plain array, K-split column blocks for the CPU fast path, quantised) is decided in one
place and the model code never changes with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] times W [out, in] transposed -> [..., out], in x's dtype.

    The explicit `x.astype(W.dtype) @ W.T` spelling matters on CPU: it is the form XLA fuses into one
    `copy_dot_fusion` that streams bf16 weights at near the memory bandwidth (docs/cpu_decode.md).
    """
    if isinstance(w, tuple):  # K pre-split column blocks [out, k_i]: sum of per-block products
        out, start = None, 0
        for block in w:
            width = block.shape[-1]
            part = linear(x[..., start : start + width], block)
            # Round each partial to the weight dtype: an add fused onto a dot breaks the fast fusion.
            part = part.astype(block.dtype).astype(x.dtype)
            out = part if out is None else out + part
            start += width
        return out
    return (x.astype(w.dtype) @ w.T).astype(x.dtype)


def lookup(table, ids: jax.Array, dtype) -> jax.Array:
    """Rows of an embedding table [V, D] for ids [...] -> [..., D] in `dtype` (not yet scaled)."""
    return jnp.take(table, ids, axis=0).astype(dtype)
