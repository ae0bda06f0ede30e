"""The protocol of a weight stored as something other than a plain array (a quantised form).

`gemmax.model.linear.linear` and `lookup` read every weight of the model. A plain array (or a tuple
of column blocks of one) they multiply themselves; anything else is a `StoredWeight`, and they only
call its protocol, so a new stored form (gemmax.quant has int8, W4A16 and 8/4-bit tables) is one new
class and no branch anywhere else:

- `matmul(x, blocks)` (a classmethod: a wide weight arrives as a tuple of column blocks of one form,
  `gemmax.engine.fastpath.prepare_params`): x [rows, in] @ W.T -> [rows, out] float32;
- `rows(ids)`: dequantised rows of a table, for ids [...] -> [..., D] float32;
- `dequantize(dtype)`: W itself;
- `w[:, a:b]`: a column block (what `prepare_params` splits wide matrices into);
- `shape`, `compute_dtype` (the dtype W had before quantisation, which matmul inputs are rounded to),
  `nbytes` (data and scales as stored) and `bytes_read(rows)` (what a product of that many rows reads:
  less than `nbytes` for a form that keeps a second copy for some row counts).

The forms are registered dataclass pytrees, so params stay a pytree: `jit`, `eval_shape` and byte
counting over `jax.tree.leaves` keep working on them.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32


class StoredWeight(abc.ABC):
    """A weight W [out, in] (or a table [V, D]) in a stored form; see the module docstring."""

    compute_dtype: str

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """(out, in) of W as the model sees it, whatever the stored arrays' shapes."""

    @abc.abstractmethod
    def dequantize(self, dtype: Any = F32) -> jax.Array:
        """W [out, in] in `dtype`."""

    def __getitem__(self, index) -> StoredWeight:
        """W[:, a:b], a column block sharing what the form can share (forms that are split override it)."""
        raise TypeError(f"{type(self).__name__} has no column blocks")

    @classmethod
    def matmul(cls, x: jax.Array, blocks: tuple[StoredWeight, ...]) -> jax.Array:
        """x [rows, in] @ W.T -> [rows, out] float32, W given as its column blocks: dequantised to the
        compute dtype and multiplied with float32 accumulation (XLA fuses the dequantisation on GPU/TPU)."""
        dtype = blocks[0].compute_dtype
        w = concat_columns([b.dequantize(dtype) for b in blocks])
        return lax.dot_general(x.astype(dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=F32)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantised rows [..., D] (float32) for ids [...]; forms that are gathered override it."""
        return jnp.take(self.dequantize(F32), ids, axis=0)

    @property
    def nbytes(self) -> int:
        """Bytes as stored: the packed data and the scales."""
        return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(self))

    def bytes_read(self, rows: int) -> int:
        """Bytes a product of `rows` rows reads (the roofline's weight traffic): everything stored."""
        return self.nbytes


def static(default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is pytree metadata (part of the treedef, hashed by `jit`), not a leaf."""
    return dataclasses.field(default=default, metadata={"static": True})


def concat_columns(parts: list[jax.Array]) -> jax.Array:
    """Column blocks [out, k_i] -> [out, sum k_i] (a single block is returned as it is)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def is_quantized(w: Any) -> bool:
    """A stored form, or a tuple of column blocks of one (after `fastpath.prepare_params`)."""
    return isinstance(w, StoredWeight) or (isinstance(w, tuple) and bool(w) and isinstance(w[0], StoredWeight))
