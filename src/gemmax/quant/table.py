"""Quantised embedding tables (the per-layer embedding, only ever gathered by row): int8 [V, D] or
packed uint8 [V, D/2] (pairs, gemmax.quant.packing), one bfloat16 scale per group of P columns (one
per token per layer); `compute_dtype` is the dtype the table had, which the model's scaling uses."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.model.stored import StoredWeight, static
from gemmax.quant.options import QuantError
from gemmax.quant.packing import pack_pairs, unpack
from gemmax.quant.rounding import by_rows, dtype_name, grouped

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTable(StoredWeight):
    q: jax.Array  # int8 [V, D] (8 bits) or uint8 [V, D/2] (4 bits: byte j = column 2j | column 2j+1 << 4)
    scales: jax.Array  # bfloat16 [V, D/group]
    bits: int = static()
    group: int = static()
    compute_dtype: str = static("bfloat16")  # the table's dtype before quantisation

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1] * (2 if self.bits == 4 else 1))

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantised rows [..., D] (float32) of ids [...]."""
        q = jnp.take(self.q, ids, axis=0)
        if self.bits == 4:
            q = jnp.stack(unpack(q), axis=-1).reshape(*q.shape[:-1], -1)
        scales = jnp.take(self.scales, ids, axis=0).astype(F32)  # [..., D/group]
        d = q.shape[-1]
        return (q.astype(F32).reshape(*q.shape[:-1], d // self.group, self.group) * scales[..., None]).reshape(*q.shape)

    def dequantize(self, dtype: Any = F32) -> jax.Array:
        return self.rows(jnp.arange(self.shape[0])).astype(dtype)


def quantize_table(table: jax.Array, bits: int, group: int) -> QuantizedTable:
    """An embedding table [V, D] -> 8 or 4 bits with one scale per `group` columns."""
    if bits not in (8, 4) or table.shape[1] % group or (bits == 4 and group % 2):
        raise QuantError(f"cannot quantise a table of {table.shape[1]} columns to {bits} bits in groups of {group}")

    def fn(rows):
        q, scales = grouped(rows, bits=bits, group=group)
        return (pack_pairs(q) if bits == 4 else q), scales

    q, scales = by_rows(fn, table)
    return QuantizedTable(q, scales, bits=bits, group=group, compute_dtype=dtype_name(table))
