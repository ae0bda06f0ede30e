"""The 4-bit layouts: how int4 values are packed two to a byte, and how a matrix is cut into the
packing chunks and scale groups that the W4A16 forms and the Pallas kernel both follow.

- Matrices (`gemmax.quant.w4a16.Int4Weight`) are packed per chunk of at most 4095 columns
  (`packing_chunks`: the same blocks `fastpath.prepare_params` splits matrices into): byte j of a
  chunk of width w holds column j (low nibble) and column w/2 + j (high nibble), so unpacking is two
  shifts and each nibble plane is a plain [out, w/2] matrix.
- Tables (`gemmax.quant.table.QuantizedTable`) are packed in pairs: byte j = column 2j | column 2j+1 << 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.model.linear import column_blocks
from gemmax.quant.options import QuantError

INT4_GROUP = 128


def packing_chunks(k: int) -> tuple[int, ...]:
    """Widths of an int4 matrix's packing chunks: `linear.column_blocks(k)` (each <= 4095, even)."""
    widths = column_blocks(k)
    if any(w % 2 for w in widths):
        raise QuantError(f"int4 packing needs chunks of an even number of columns; {k} inputs give {widths}")
    return widths


def int4_group(k: int) -> int:
    """Group size for a matrix with k inputs: the smallest over its packing chunks (`int4_group_of_chunk`)."""
    return min(int4_group_of_chunk(w) for w in packing_chunks(k))


def int4_group_of_chunk(width: int) -> int:
    """INT4_GROUP, halved until it divides the chunk's half width (both nibble planes split into groups)."""
    group = INT4_GROUP
    while group > 1 and (width // 2) % group:
        group //= 2
    return group


def nibbles(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Two int8 arrays of values in [-8, 7] -> one uint8 array (lo in the low nibble)."""
    return (lo.astype(jnp.uint8) & 15) | (hi.astype(jnp.uint8) << 4)


def unpack(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes -> (low nibbles, high nibbles) as two's-complement int8 values in [-8, 7]."""
    q = lax.bitcast_convert_type(packed, jnp.int8)
    return (q << 4) >> 4, q >> 4


@functools.partial(jax.jit, static_argnames=("chunks",))
def pack_matrix(q: jax.Array, chunks: tuple[int, ...]) -> jax.Array:
    """int8 values [R, C] in [-8, 7] -> uint8 [R, C/2], chunk by chunk (the matrix layout above)."""
    parts, start = [], 0
    for width in chunks:
        parts.append(nibbles(q[:, start : start + width // 2], q[:, start + width // 2 : start + width]))
        start += width
    return jnp.concatenate(parts, axis=1)


@jax.jit
def pack_pairs(q: jax.Array) -> jax.Array:
    """int8 values [R, C] in [-8, 7] -> uint8 [R, C/2] (the table layout above)."""
    return nibbles(q[:, 0::2], q[:, 1::2])
