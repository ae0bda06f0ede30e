"""The XLA:CPU matrix-vector spelling that the int8 and int4 forms share (measured in
docs/quantization.md on a 2-core Zen 4 under load).

One row runs the fused matrix-vector form: the vector times the weight converted to float32 inside
the dot, `(x @ q.astype(f32).T) * scale` for int8 (~19 Gparam/s, about 2x the bf16 form) and one dot
per nibble plane with the group scales multiplied in for int4 (~9-13 Gparam/s; the bytes are read
once per plane). Spellings that unpack into an interleaved [out, in] matrix, or reduce rows
(`(W * x).sum(-1)`), make XLA materialise or loop (0.1-1 Gparam/s). Up to ROW_LOOP_MAX rows (batched
decode) run that form row by row, which beats dequantising the weight every step; more rows
(prefill) dequantise once and use the GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.model.linear import flat_vector

F32 = jnp.float32
ROW_LOOP_MAX = 8  # up to this many rows, the CPU form runs row by row (batched decode)


def row_by_row(x: jax.Array, gemv: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """x [rows, in] -> [rows, out] float32, one `gemv` ([1, in] -> [1, out]) per row."""
    rows = [gemv(x[r : r + 1]) for r in range(x.shape[0])]
    return rows[0] if len(rows) == 1 else jnp.concatenate(lax.optimization_barrier(rows), axis=0)


def gemv_vector(x: jax.Array, compute_dtype: str) -> jax.Array:
    """One row x [1, in] as the fused dot must read it: rounded to the compute dtype, as the plain bf16
    path does (x.astype(W.dtype)), then a plain float32 row (`linear.flat_vector`). The rounding also
    keeps the vector's producer (final norm, residual add) out of the dot's fusion: fused into the
    vector side it made the int8 LM head 2-4x slower (measured on the E2B-shaped decode step)."""
    return flat_vector(x.astype(compute_dtype).astype(F32))


def sum_parts(parts: list[jax.Array]) -> jax.Array:
    """The sum of per-block matrix-vector products."""
    if len(parts) == 1:
        return parts[0]
    # An add fused onto a matrix-vector dot makes XLA:CPU copy the weight out (see gemmax.model.linear).
    parts = lax.optimization_barrier(parts)
    return sum(parts[1:], parts[0])
