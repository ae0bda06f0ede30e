"""How a weight becomes integers and scales: symmetric int8 per row, int8 / int4 per group of columns.

Scales are bfloat16 (float32's range in 2 bytes, a 2^-9 relative rounding that is small next to the
quantisation step itself), and the integers are rounded against the stored (rounded) scale. Big
tables are quantised `CHUNK_ROWS` rows at a time, so peak host memory stays near the quantised size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

F32 = jnp.float32
CHUNK_ROWS = 8192  # big tables are quantised this many rows at a time (bounded temporaries)


@jax.jit
def int8_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row: w [R, C] -> (q int8 [R, C], scale bfloat16 [R]); q from the rounded scale."""
    wf = w.astype(F32)
    scale = (jnp.max(jnp.abs(wf), axis=-1) / 127.0).astype(jnp.bfloat16)
    s = scale.astype(F32)
    q = jnp.round(wf / jnp.where(s > 0, s, 1.0)[:, None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


@functools.partial(jax.jit, static_argnames=("bits", "group"))
def grouped(w: jax.Array, bits: int, group: int) -> tuple[jax.Array, jax.Array]:
    """Per group of `group` columns: w [R, C] -> (q int8 [R, C], scales bfloat16 [R, C/group]).

    8 bits: symmetric, absmax -> 127. 4 bits (Q4_0): the largest-magnitude value m maps to -8, so the
    scale is m / -8 and the 16 levels -8..7 are all used."""
    r, c = w.shape
    wf = w.astype(F32).reshape(r, c // group, group)
    if bits == 8:
        scale = jnp.max(jnp.abs(wf), axis=-1) / 127.0
        lo, hi = -127, 127
    else:
        extreme = jnp.take_along_axis(wf, jnp.argmax(jnp.abs(wf), axis=-1)[..., None], axis=-1)[..., 0]
        scale = extreme / -8.0
        lo, hi = -8, 7
    scale = scale.astype(jnp.bfloat16)
    s = scale.astype(F32)
    q = jnp.round(wf / jnp.where(s != 0, s, 1.0)[..., None])
    return jnp.clip(q, lo, hi).astype(jnp.int8).reshape(r, c), scale


def by_rows(fn: Callable, w: jax.Array) -> tuple[jax.Array, ...]:
    """fn over row chunks of w, outputs concatenated: big tables never need f32 temporaries of their full size."""
    if w.shape[0] <= CHUNK_ROWS:
        return fn(w)
    outs = [fn(w[i : i + CHUNK_ROWS]) for i in range(0, w.shape[0], CHUNK_ROWS)]
    return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*outs, strict=True))


def dtype_name(w: Any) -> str:
    return jnp.dtype(w.dtype).name
