"""int8 weights: W [out, in] as q int8 [out, in] with one bfloat16 scale per output channel
(W ~ q * scale[:, None]), and how they are multiplied on each device.

- "cpu" (XLA:CPU): one row (batch-1 decode, the bandwidth-bound case int8 is for) and up to
  `GEMM_MIN_ROWS` - 1 rows, the fused matrix-vector form row by row (gemmax.quant.cpu). From
  `GEMM_MIN_ROWS` rows (batched decode at 8 slots, prefill) a layer matrix multiplies its `gemm` copy
  (the int8 values held in bf16, exact) by XLA:CPU's GEMM: the GEMM cannot fuse a convert, and
  converting every step cost more than it saves (`GEMM_MIN_ROWS`). The LM head has no copy (the
  tied embedding is already held once in bf16 and once in int8): at 4-8 rows it is converted tile by
  tile inside a loop and multiplied by the GEMM (`tiled`), read once as int8, each bf16 tile used
  while it is in cache; more rows do the same with smaller tiles. A copy was tried (2026-12-05,
  built-in model, batch-8 decode step at 128 cached tokens, `gemmax profile`, two alternations):
  45.0 / 48.2 ms with the tiles, 52.9 / 50.4 ms with the copy, whose one dot took 25.6 ms where
  the tiles' conversion and dots took 5.0-5.6 + 11.7-11.8 (the GEMM appears to repack its whole
  336 MB operand); and tiles of 1024 / 2048 / 8192 rows gave 50.1 / 48.5 / 47.7 ms against 45.7
  for 4096. Only bf16 weights on a CPU not known to lack bf16 instructions keep a copy: elsewhere the
  GEMM would run in f32 (4 bytes a weight) or in emulated float16, and tiles are converted instead
  (`gemmax.quant.cpu.gemm_dtype`).
- "xla" (GPU, TPU): the int8 values converted to the compute dtype inside the dot, float32
  accumulation, the scales applied to the output.

The int8 LM head is an extra `params["lm_head"]` `Int8Weight` of the tied embedding: the gather keeps
the table's precision, only the head's matmul reads int8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.model.linear import linear
from gemmax.model.params import count_bytes
from gemmax.model.stored import StoredWeight, concat_columns, static
from gemmax.quant.cpu import ROW_LOOP_MAX, gemm_dtype, gemv_vector, row_by_row, sum_parts
from gemmax.quant.rounding import by_rows, dtype_name, int8_rows

F32 = jnp.float32
TILED_MIN_ROWS, TILED_MIN_PARAMS = 4, 1 << 24  # int8 matrices this big at this many rows: `tiled`
# From this many rows a matrix with a `gemm` copy multiplies it by the GEMM. The built-in model's
# 126 layer matrices (2-core Zen 4, jit of all of them, ms): rows 1: int8 row form 3.4, bf16 GEMM 6.2;
# rows 2: 6.0-7.4 / 14-17; rows 4: 14-16 / 16-19; rows 8: 24-29 / 16-18; 32: 35 (int8 tiles) / 29;
# 512: 381 / 346. XLA:CPU's bf16 GEMM costs ~11 ms for these weights at any small row count (it
# repacks its weight operand on every call), so the row form wins below 8 rows.
GEMM_MIN_ROWS = 8
DEQUANT_TILE_ROWS = 4096  # int8 rows converted at a time for a batched-decode GEMM (4096 x 640 bf16: 5 MB)
# Prefill (more than ROW_LOOP_MAX rows): tiles of at most this many weights (2 MB in f32), so each
# converted tile is multiplied while it is in cache. Converting a whole matrix first wrote it out and
# read it back: on a 2-core Zen 3, 18 chained [32, 640] x [640, 2048] int8 GEMMs took 72 ms converted
# whole and 37-39 ms in tiles of 128-1024 rows (bf16 weights, nothing to convert: 32 ms). Four
# [32, 12288] x [12288, 1536] products of one unsplit matrix: 228 ms whole, 109 ms in 64-row tiles
# (the CPU engine splits such a matrix into column blocks of at most 4095 inputs first, whose tiles
# are 170 rows or more: `gemmax.engine.fastpath.prepare_params`).
PREFILL_TILE_PARAMS = 1 << 19


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight(StoredWeight):
    q: jax.Array  # int8 [out, in]
    scale: jax.Array  # bfloat16 [out]
    gemm: jax.Array | None = None  # q as bfloat16 [out, in] (exact: |q| <= 127), for GEMM_MIN_ROWS+ rows on CPU
    kernel: str = static("xla")
    compute_dtype: str = static("bfloat16")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def __getitem__(self, index) -> Int8Weight:
        """W[:, a:b]: a column block (`fastpath.prepare_params` splits wide matrices); shares the scales."""
        _, cols = index
        return dataclasses.replace(self, q=self.q[:, cols], gemm=None if self.gemm is None else self.gemm[:, cols])

    def dequantize(self, dtype: Any = F32) -> jax.Array:
        return (self.q.astype(F32) * self.scale.astype(F32)[:, None]).astype(dtype)

    def rows(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.q, ids, axis=0).astype(F32) * jnp.take(self.scale, ids, axis=0).astype(F32)[..., None]

    def bytes_read(self, rows: int) -> int:
        """The int8 values and scales, or from GEMM_MIN_ROWS rows the bf16 copy and scales."""
        return count_bytes((self.gemm if self.gemm is not None and rows >= GEMM_MIN_ROWS else self.q, self.scale))

    @classmethod
    def matmul(cls, x: jax.Array, blocks: tuple[Int8Weight, ...]) -> jax.Array:
        if blocks[0].gemm is not None and x.shape[0] >= GEMM_MIN_ROWS:
            x = x.astype(blocks[0].compute_dtype).astype(x.dtype)  # rounded as every form rounds it
            return linear(x, tuple(b.gemm for b in blocks)).astype(F32) * blocks[0].scale.astype(F32)
        if blocks[0].kernel == "cpu" and tiled(x.shape[0], blocks):
            return _tiles(x, blocks, DEQUANT_TILE_ROWS)
        if blocks[0].kernel == "cpu" and x.shape[0] <= ROW_LOOP_MAX:
            return row_by_row(x, lambda row: _gemv(row, blocks))
        if blocks[0].kernel == "cpu":  # prefill
            return _tiles(x, blocks, PREFILL_TILE_PARAMS // max(b.shape[1] for b in blocks))  # >= 64 rows: `_tile_rows`
        dtype = blocks[0].compute_dtype
        q = concat_columns([b.q for b in blocks])
        y = lax.dot_general(x.astype(dtype), q.astype(dtype), (((1,), (1,)), ((), ())), preferred_element_type=F32)
        return y * blocks[0].scale.astype(F32)


def gemm_copy_bytes(params: Any) -> int:
    """Bytes of the bf16 GEMM copies held by the int8 weights in `params` (arrays or ShapeDtypeStructs)."""
    return count_bytes([w.gemm for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int8Weight))
                        if isinstance(w, Int8Weight)])


def quantize_int8(w: jax.Array, kernel: str = "xla", gemm_copy: bool = False) -> Int8Weight:
    """W [out, in] -> int8 per output channel; with `gemm_copy` on CPU, also the bf16 copy of the int8
    values that GEMM_MIN_ROWS+ rows multiply: only where the GEMM runs in bf16 (bf16 weights on a CPU
    not known to lack bf16 instructions: `gemm_dtype`; float16 and float32 weights keep no copy)."""
    q, scale = by_rows(int8_rows, w)
    compute = dtype_name(w)
    copy = gemm_copy and kernel == "cpu" and gemm_dtype(compute) == "bfloat16"
    return Int8Weight(q, scale, q.astype(jnp.bfloat16) if copy else None, kernel=kernel, compute_dtype=compute)


def _gemv(x: jax.Array, blocks: tuple[Int8Weight, ...]) -> jax.Array:
    """One row x [1, in] -> [1, out] float32 in XLA:CPU's fused matrix-vector form (gemmax.quant.cpu):
    the int8 values are converted inside the dot, the scales applied after."""
    x = gemv_vector(x, blocks[0].compute_dtype)
    parts, start = [], 0
    for b in blocks:
        parts.append(x[:, start : start + b.shape[1]] @ b.q.astype(F32).T)
        start += b.shape[1]
    return sum_parts(parts) * blocks[0].scale.astype(F32)


def tiled(rows: int, blocks: tuple[Int8Weight, ...]) -> bool:
    """Whether the CPU kernel multiplies `rows` rows by these int8 blocks through `_tiles` rather than
    row by row. Measured on the built-in model's decode step (its 168 MB int8 LM head; the other
    matrices fit in cache, where the row loop re-reads them cheaply): batch 8 91 -> 65 ms, batch 4
    47 -> 37 ms, batch 2 22 -> 24 ms (slower: two rows read the head only twice)."""
    return TILED_MIN_ROWS <= rows <= ROW_LOOP_MAX and sum(math.prod(b.shape) for b in blocks) >= TILED_MIN_PARAMS


def _tile_rows(n: int, max_rows: int) -> int:
    """Output rows dequantised at a time: the largest divisor of n up to max(max_rows, 64) that is at
    least 64 (n if none exists). The floor keeps each tile a GEMM, not a sliver: a matrix wider than
    PREFILL_TILE_PARAMS / 64 inputs that was not split into column blocks goes in 64-row tiles, not whole."""
    max_rows = max(max_rows, 64)
    for count in range(-(-n // max_rows), n // 64 + 1):
        if n % count == 0:
            return n // count
    return n


def _tiles(x: jax.Array, blocks: tuple[Int8Weight, ...], max_rows: int) -> jax.Array:
    """x [rows, in] (batched decode, prefill) @ W.T -> [rows, out] float32: a loop over tiles of
    output rows, each converted to the compute dtype (exact: |q| <= 127) and multiplied by XLA:CPU's
    GEMM (`gemmax.model.linear`), scales applied after. The weight is read once as int8; its bf16
    tile (at most max_rows x in; f32 where bf16 is emulated: `cpu.gemm_dtype`) stays in cache for
    the GEMM."""
    dtype = gemm_dtype(blocks[0].compute_dtype)
    x = x.astype(blocks[0].compute_dtype).astype(x.dtype)  # rounded as every form rounds it: the same product in f32
    parts, start = [], 0
    for b in blocks:
        n, k = b.shape
        xs = x[:, start : start + k]
        tile = _tile_rows(n, max_rows)
        _, ys = lax.scan(lambda carry, q, xs=xs: (carry, linear(xs, q.astype(dtype)).astype(F32)), None,
                         b.q.reshape(n // tile, tile, k))  # ys [n / tile, rows, tile]
        parts.append(ys.transpose(1, 0, 2).reshape(x.shape[0], n))
        start += k
    return sum(parts[1:], parts[0]) * blocks[0].scale.astype(F32)
