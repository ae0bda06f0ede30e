"""The XLA:CPU matrix-vector spelling that the int8 and int4 forms share (measured in
docs/quantization.md on a 2-core Zen 4 under load).

One row runs the fused matrix-vector form: the vector times the weight converted to float32 inside
the dot, `(x @ q.astype(f32).T) * scale` for int8 (~19 Gparam/s, about 2x the bf16 form) and one dot
per nibble plane with the group scales multiplied in for int4 (~9-13 Gparam/s; the bytes are read
once per plane). Spellings that unpack into an interleaved [out, in] matrix, or reduce rows
(`(W * x).sum(-1)`), make XLA materialise or loop (0.1-1 Gparam/s). Up to ROW_LOOP_MAX rows (batched
decode) run that form row by row, which beats dequantising the weight every step; from 8 rows an
int8 layer matrix with a bf16 copy multiplies the copy by the GEMM (gemmax.quant.int8), and a weight
without one (the int8 LM head, int4) converts tile by tile, each tile multiplied by the GEMM while in cache.

The GEMM's dtype depends on the CPU (`gemm_dtype`): with bf16 dot instructions (x86 AVX512_BF16 or
AMX-BF16, Arm BF16) XLA:CPU's bf16 GEMM is the fastest (2-core Zen 4: 234 GFLOP/s at 32x640x2048
against 120-173 in f32); without them bf16 is emulated: converting int8 to bf16 rounds in software and
the bf16 GEMM is slower than f32. Measured on a 2-core Zen 3 (no AVX-512), one 2048 x 640 int8 matrix:
convert to bf16 1.67 ms, to f32 0.25 ms; dequantise and multiply 32 rows 3.36 ms in bf16, 1.36 ms in
f32 (the built-in model's 32-token prefill chunk spent 70-76% of its time in those converts). There the
int8 GEMMs run in f32, which is exact for the int8 values.
"""

from __future__ import annotations

import functools
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


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo: x86 flags, the Arm feature


@functools.cache
def native_bf16() -> bool | None:
    """Whether this host's CPU has bf16 dot-product instructions (`BF16_FLAGS` in /proc/cpuinfo's
    flags or features); None where the file is not there (not Linux: nothing known)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return bool(set(value.split()) & set(BF16_FLAGS))
    except OSError:
        return None
    return None


def gemm_dtype(compute_dtype: str) -> str:
    """The dtype int8 weights are converted to for an XLA:CPU GEMM (prefill, batched-decode tiles):
    float32 for bf16 on a CPU known to lack bf16 instructions, else the compute dtype."""
    return "float32" if compute_dtype == "bfloat16" and native_bf16() is False else compute_dtype


def sum_parts(parts: list[jax.Array]) -> jax.Array:
    """The sum of per-block matrix-vector products."""
    if len(parts) == 1:
        return parts[0]
    # An add fused onto a matrix-vector dot makes XLA:CPU copy the weight out (see gemmax.model.linear).
    parts = lax.optimization_barrier(parts)
    return sum(parts[1:], parts[0])
