"""W4A16 weights: W [out, in] as two's-complement 4-bit values with one bfloat16 scale per `group`
input columns (group 128, or the largest power of two below it that divides the packing), Q4_0-style:
the group's largest-magnitude value maps to -8. Packed per chunk (gemmax.quant.packing), so each
nibble plane is a plain [out, w/2] matrix that XLA:CPU reads inside its fused matrix-vector dot.

How they are multiplied (`kernel`, chosen at load for the device by gemmax.quant.plan.resolve):
- "cpu" (XLA:CPU): up to `ROW_LOOP_MAX` rows, one dot per nibble plane with the group scales
  multiplied in, row by row (gemmax.quant.cpu); more rows dequantise once and use the GEMM.
- "xla" (GPU, TPU): dequantise and dot with float32 accumulation; XLA fuses the dequantisation.
- "pallas" / "pallas_interpret": the fused Pallas kernel (gemmax.quant.pallas_w4a16) with tiles
  checked against the device's on-chip memory at start-up; interpret mode is the CPU simulator.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.model.stored import StoredWeight, static
from gemmax.quant.cpu import ROW_LOOP_MAX, gemv_vector, row_by_row, sum_parts
from gemmax.quant.options import W4Tiles
from gemmax.quant.packing import int4_group, pack_matrix, packing_chunks, unpack
from gemmax.quant.pallas_w4a16 import w4a16_matmul
from gemmax.quant.rounding import by_rows, dtype_name, grouped

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight(StoredWeight):
    packed: jax.Array  # uint8 [out, in/2]: per chunk of width w, byte j = column j | column w/2 + j << 4
    scales: jax.Array  # bfloat16 [out, in/group]
    group: int = static()
    chunks: tuple[int, ...] = static()  # packing chunk widths, summing to in
    kernel: str = static("xla")
    tiles: W4Tiles | None = static(None)
    compute_dtype: str = static("bfloat16")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], sum(self.chunks))

    def __getitem__(self, index) -> Int4Weight:
        """W[:, a:b] for a, b on chunk boundaries (what `fastpath.prepare_params` asks for)."""
        _, cols = index
        a, b = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        bounds = [0, *itertools.accumulate(self.chunks)]
        if a not in bounds or b not in bounds or b <= a:
            raise ValueError(f"int4 weight columns [{a}:{b}] do not follow its packing chunks {self.chunks}")
        chunks = self.chunks[bounds.index(a) : bounds.index(b)]
        return dataclasses.replace(self, packed=self.packed[:, a // 2 : b // 2],
                                   scales=self.scales[:, a // self.group : b // self.group], chunks=chunks)

    def planes(self) -> list[tuple[int, int, jax.Array, jax.Array]]:
        """[(start column, width, low plane, high plane)] per chunk; planes [out, width/2] float32, scaled."""
        out, start, planes = self.packed.shape[0], 0, []
        for width in self.chunks:
            half, groups = width // 2, width // (2 * self.group)
            packed = self.packed if len(self.chunks) == 1 else self.packed[:, start // 2 : (start + width) // 2]
            scales = self.scales[:, start // self.group : (start + width) // self.group].astype(F32)
            lo, hi = unpack(packed)
            lo = (lo.astype(F32).reshape(out, groups, self.group) * scales[:, :groups, None]).reshape(out, half)
            hi = (hi.astype(F32).reshape(out, groups, self.group) * scales[:, groups:, None]).reshape(out, half)
            planes.append((start, width, lo, hi))
            start += width
        return planes

    def dequantize(self, dtype: Any = F32) -> jax.Array:
        return jnp.concatenate([p for _, _, lo, hi in self.planes() for p in (lo, hi)], axis=1).astype(dtype)

    @classmethod
    def matmul(cls, x: jax.Array, blocks: tuple[Int4Weight, ...]) -> jax.Array:
        kernel = blocks[0].kernel
        if kernel == "cpu" and x.shape[0] <= ROW_LOOP_MAX:
            return row_by_row(x, lambda row: _gemv(row, blocks))
        if kernel in ("pallas", "pallas_interpret"):
            return _pallas(x, blocks, interpret=kernel == "pallas_interpret")
        return super().matmul(x, blocks)


def quantize_int4(w: jax.Array, kernel: str = "xla", tiles: W4Tiles | None = None) -> Int4Weight:
    """W [out, in] -> int4 with group-wise scales, packed per chunk (see the module docstring)."""
    chunks, group = packing_chunks(w.shape[1]), int4_group(w.shape[1])
    q, scales = by_rows(functools.partial(grouped, bits=4, group=group), w)
    return Int4Weight(pack_matrix(q, chunks), scales, group=group, chunks=chunks, kernel=kernel, tiles=tiles,
                      compute_dtype=dtype_name(w))


def _gemv(x: jax.Array, blocks: tuple[Int4Weight, ...]) -> jax.Array:
    """One row x [1, in] -> [1, out] float32 in XLA:CPU's fused matrix-vector form (gemmax.quant.cpu):
    one dot per nibble plane, the unpacking, convert and group scales inside it."""
    x = gemv_vector(x, blocks[0].compute_dtype)
    parts, start = [], 0
    for b in blocks:
        for chunk_start, width, lo, hi in b.planes():
            c = start + chunk_start
            parts.append(x[:, c : c + width // 2] @ lo.T)
            parts.append(x[:, c + width // 2 : c + width] @ hi.T)
        start += b.shape[1]
    return sum_parts(parts)


def _pallas(x: jax.Array, blocks: tuple[Int4Weight, ...], interpret: bool) -> jax.Array:
    """Sum over packing chunks of the fused W4A16 kernel's products."""
    parts, start = [], 0
    for b in blocks:
        offset = 0
        for width in b.chunks:
            c = start + offset
            packed = b.packed[:, offset // 2 : (offset + width) // 2]
            scales = b.scales[:, offset // b.group : (offset + width) // b.group]
            parts.append(w4a16_matmul(x[:, c : c + width].astype(b.compute_dtype), packed, scales, group=b.group,
                                      tiles=b.tiles, interpret=interpret))
            offset += width
        start += b.shape[1]
    return sum(parts[1:], parts[0])
