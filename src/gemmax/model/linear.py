"""The two weight reads of the model: `linear` (x @ W.T) and `lookup` (table rows by id).

Every matrix product and every embedding gather in the model goes through these, so a weight's
stored form (plain array, K-split column blocks for the CPU fast path, quantised) is decided in one
place and the model code never changes with it. `gemmax.engine.fastpath.prepare_params` picks the
stored form for the device; docs/cpu_decode.md has the measurements behind the spellings here.

Stored forms of a weight W [out, in]:
- an array [out, in];
- a tuple of column blocks ([out, k_0], [out, k_1], ...) with sum(k_i) = in: the CPU fast path
  for in > `GEMV_MAX_IN`;
- a `StoredWeight` (gemmax.model.stored: the quantised forms of gemmax.quant; or column blocks of
  one): multiplied and gathered through its protocol, so this module knows no concrete form.

Two spellings, chosen from the static number of rows of x:
- one row (decode at batch 1): `x[1, in].astype(W.dtype).astype(x.dtype) @ W.T` (bf16-rounded
  products, f32 output), x flattened to 2-D first. XLA:CPU
  fuses the weight's convert and transpose into one `copy_dot_fusion` that streams bf16 weights at
  near memory bandwidth; a 3-D x, an `einsum`/`dot_general` spelling, a vector over 16 KiB or an add
  fused onto the dot's output each break that fusion and make XLA materialise an f32 copy of W on
  every step (20x slower). Partial products of a K-split weight are therefore kept apart from their
  sum by an optimisation barrier.
- several rows (batched decode, prefill): `dot_general` with float32 accumulation, which XLA:CPU
  hands to its YNNPACK GEMM (bf16 products, f32 sums) and GPUs run natively. On CPU, up to 64 rows,
  the weight is the dot's left operand (`streams_weight`): YNNPACK then streams it instead of
  repacking it on every call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.model.stored import StoredWeight

# Largest `in` whose float32 vector (in * 4 bytes) stays under the 16 KiB XLA:CPU's matrix-vector
# fusion accepts: 4096 already falls back to an f32 copy of the weight (checked in tests).
GEMV_MAX_IN = 4095

# Most rows for which the CPU GEMM takes the weight as its left operand (`streams_weight`), and the
# fewest from which every weight does, whatever its width.
STREAM_MAX_ROWS = 64
STREAM_ANY_MIN_ROWS = 32

# Column blocks are a multiple of this many inputs (cache lines of bf16, SIMD-friendly widths).
_BLOCK_ALIGN = 64


def column_blocks(n_in: int, max_in: int = GEMV_MAX_IN) -> tuple[int, ...]:
    """Widths of near-equal, 64-aligned column blocks of `n_in` inputs, each <= max_in, as few as alignment allows.

    6144 -> (3072, 3072); 12288 -> (3072,) * 4; 4096 -> (2048, 2048); 8960 -> (3008, 3008, 2944).
    """
    if n_in <= max_in:
        return (n_in,)
    align = _BLOCK_ALIGN if max_in >= _BLOCK_ALIGN else 1
    width = math.ceil(math.ceil(n_in / math.ceil(n_in / max_in)) / align) * align
    width = min(width, max_in // align * align)
    count = math.ceil(n_in / width)
    return (width,) * (count - 1) + (n_in - width * (count - 1),)


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] times W [out, in] transposed -> [..., out], in x's dtype (float32 accumulation)."""
    blocks = w if isinstance(w, tuple) else (w,)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k)  # [rows, in]: a 3-D operand loses the CPU matrix-vector fusion
    if isinstance(blocks[0], StoredWeight):
        if sum(b.shape[1] for b in blocks) != k:
            raise ValueError(f"weight has {sum(b.shape[1] for b in blocks)} inputs but x has {k}")
        y = type(blocks[0]).matmul(x2, blocks).astype(x.dtype)
    else:
        y = _blocks(x2, w) if isinstance(w, tuple) else _product(x2, w)
    return y.reshape(*lead, y.shape[-1])


def _product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [rows, in] @ W[out, in].T -> [rows, out] in x.dtype."""
    if x.shape[0] == 1:
        # x rounded to W's dtype (the products the batched form computes), multiplied in x's dtype:
        # XLA still fuses W's convert into the matrix-vector dot, and the output keeps f32 precision
        # (a bf16-rounded output makes logits tie, and the batch-1 and batched paths disagree).
        return flat_vector(x.astype(w.dtype).astype(x.dtype)) @ w.T
    if streams_weight(x.shape[0], w):
        return _weight_on_the_left(x, w)
    y = lax.dot_general(x.astype(w.dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def streams_weight(rows: int, w: jax.Array) -> bool:
    """Whether `rows` rows times W [out, in] use `_weight_on_the_left` (CPU only).

    XLA:CPU's YNNPACK GEMM reads bf16 weights at 11-13 GB/s at batch 8 with W as its right operand
    (x @ W.T) and at 14-17 GB/s with W as its left operand (E2B shapes; f32 weights 6 vs 12 GB/s);
    it appears to repack its right operand on every call. Measured (docs/cpu_decode.md): faster up
    to 64 rows (512-row prefill buckets are faster with W on the right) for 1024-3072 inputs; at
    decode's few rows slower below 1024 inputs (384, 512, 640) and when a row of W is a multiple of
    4 KiB (2048 bf16 inputs: 10 vs 14 GB/s; presumably rows that far apart share cache sets), so
    those keep the plain form below STREAM_ANY_MIN_ROWS rows. From 32 rows (a 32-token prefill
    chunk, a verify step of several rows) they stream too. Gemma 3 270M's 126 layer products (640,
    1024 and 2048 inputs, bf16, one jit, 2-core Zen 4, 2026-12-05), ms, as before (only the
    1024-input ones streamed) against every weight streamed: 32 rows 28.9-29.5 -> 23.7-24.4, 64 rows
    46.8-48.0 -> 38.0, 16 rows 20.5-20.9 -> 20.0 (kept as before: within noise), 128 rows (none
    streamed) 96.0 -> 101.9. Only those bf16 shapes were measured: f32 weights and E2B's 4 KiB-row
    projections at 32-64 rows (a decode group of 32 or 64, a verify step) follow the rule untested."""
    k = w.shape[1]
    wide = k >= 1024 and (k * w.dtype.itemsize) % 4096 != 0
    return (1 < rows <= STREAM_MAX_ROWS and (wide or rows >= STREAM_ANY_MIN_ROWS)
            and jax.default_backend() == "cpu")


def _weight_on_the_left(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [rows, in] @ W[out, in].T computed as (W @ x.T).T -> [rows, out] in x.dtype.

    The optimisation barrier keeps XLA from folding the transpose back into the dot (it would swap
    the operands again). The transpose goes through [out / 64, 64, rows] tiles: a plain one became a
    layout change that a later copy paid for (2.4 ms for batch-8 logits, against 0.8 ms through tiles)."""
    y = lax.dot_general(w, x.astype(w.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    y = lax.optimization_barrier(y)  # [out, rows]
    out, rows = y.shape
    tile = 64 if out % 64 == 0 else 1
    return y.reshape(out // tile, tile, rows).transpose(2, 0, 1).reshape(rows, out).astype(x.dtype)


def flat_vector(x: jax.Array) -> jax.Array:
    """x [1, in] (f32) materialised as a plain row by its own small reduction (a sum with a zero row).

    XLA fuses a vector's reshape into the matrix-vector dot that reads it. When the vector comes out
    of an op XLA cannot fuse into (the attention's p.v product, a YNNPACK fusion of shape [heads,
    head_dim]), the dot then indexes an [h, d] array as [h * d] in its inner loop and runs ~10x slower
    (the o-projection of Gemma 3 270M: 260 us instead of 25). A reduction is never fused into the
    dot's operand, and it absorbs the reshape and rounding on its input side, so the dot reads a flat
    f32 parameter; it costs ~1 us. (An optimization barrier does not survive to fusion on XLA:CPU.)
    `tests/test_fastpath.py` checks that every matrix-vector dot reads its vector as a plain operand."""
    return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)


def _blocks(x: jax.Array, blocks: tuple[jax.Array, ...]) -> jax.Array:
    """x [rows, in] times column blocks [out, k_i] of W -> [rows, out]: the sum of per-block products."""
    parts, start = [], 0
    for block in blocks:
        width = block.shape[-1]
        parts.append(_product(x[:, start : start + width], block).astype(jnp.float32))
        start += width
    if start != x.shape[-1]:
        raise ValueError(f"column blocks cover {start} inputs but x has {x.shape[-1]}")
    if x.shape[0] == 1:
        # An add fused onto a matrix-vector dot makes XLA:CPU copy W out transposed in f32.
        parts = lax.optimization_barrier(parts)
    return sum(parts[1:], parts[0]).astype(x.dtype)


def lookup(table, ids: jax.Array, dtype) -> jax.Array:
    """Rows of an embedding table [V, D] (or its column blocks) for ids [...] -> [..., D] in `dtype`."""
    if isinstance(table, StoredWeight):  # 8 / 4-bit tables (gemmax.quant.table)
        return table.rows(ids).astype(dtype)
    if isinstance(table, tuple):
        return jnp.concatenate([jnp.take(block, ids, axis=0).astype(dtype) for block in table], axis=-1)
    return jnp.take(table, ids, axis=0).astype(dtype)
