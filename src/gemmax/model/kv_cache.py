"""The KV cache: one registered-dataclass pytree that owns its layout, and everything that reads or
moves it (init, write, read, visible slots, row gather / scatter, bytes).

Layout (one entry per layer; `None` for KV-sharing "reuse" layers, which read their donor's):
    LayerCache.k, .v   [B, S, nkv, hd]
with S = `max_len` for full-attention layers and a ring of S = min(window + ring_slack, max_len) slots
for sliding layers (`ring_slack` = 0 unless speculative decoding is on, below). The slot of absolute position p is `p` (full) or `p % S` (ring), so a slot's content
is a function of real positions only. Padding tokens are never written (their scatter index is out
of range and dropped), and in a ring only the last S real positions of a chunk are written, so no
two writes race for one slot. Which position a slot holds is computed from the row's cached length
(`slot_positions`), never from slot order.

Stored forms, by the cache dtype:
- float32: the values as they are;
- 16-bit floats (bf16, f16): the values' bits as uint16, with the float dtype a static field.
  XLA:CPU widens every update of a bf16 array (scatter, dynamic update slice) to float32, converting
  the whole cache there and back on each step (60 ms of a 187 ms batch-8 step of the E2B-shaped
  model in a 4,224-slot cache); integer updates run in place, and reading reinterprets the bits
  inside the attention's own fusion;
- int8: symmetric int8 per position and head, with float32 scales `k_scale`, `v_scale` [B, S, nkv].

Speculative decoding writes k proposed positions p+1..p+k at once and may roll some back. In a ring
of exactly `window` slots those writes would overwrite positions p+1-window..p+k-window, which the
next query (at p+1 at least) may still see. With `ring_slack` = k_max extra slots the writes only
overwrite positions <= p+k-(window+k_max) <= p-window, which no later query sees; a rejected
position's slot then holds garbage that `slot_positions` attributes to a position a whole ring
earlier, also outside every later window (masked by absolute position), until the real position
overwrites it. So a rollback is just a shorter cached length: nothing is copied back.

`gemmax fit` counts the cache's bytes from `jax.eval_shape` of `init_cache` (`cache_bytes`), so the
plan and the allocation cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.model.config import LayerSpec, ModelConfig
from gemmax.model.ops import opaque
from gemmax.model.params import count_bytes


def _static(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


def _stored_as_bits(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def _quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per vector of the last dim: x [..., d] -> (q int8 [..., d], scale f32 [...])."""
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127.0
    q = jnp.round(x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def _dequantize_int8(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of `_quantize_int8`: q [..., d] * scale [...] in `dtype`."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def cache_slots(spec: LayerSpec, max_len: int, ring_slack: int = 0) -> int:
    """Slots a layer keeps per row: its ring (window + ring_slack) on sliding layers, max_len on full ones."""
    return min(spec.sliding_window + ring_slack, max_len) if spec.sliding_window else max_len


def slot_positions(cached: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """Absolute position held by each slot ([B, S]) and whether it holds one, for rows with `cached[b]`
    tokens cached. Slot s holds the latest position p < cached with p % S == s."""
    s = jnp.arange(slots)[None, :]
    last = cached[:, None] - 1
    pos = s + slots * jnp.floor_divide(last - s, slots)
    return pos, s <= last


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """K and V of one KV-owning layer (see the module docstring for the stored forms)."""

    k: jax.Array  # [B, S, nkv, hd]
    v: jax.Array  # [B, S, nkv, hd]
    k_scale: jax.Array | None = None  # float32 [B, S, nkv] (int8 cache)
    v_scale: jax.Array | None = None
    dtype: str = _static("float32")  # the dtype the values are held in

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def read(self, name: str, dtype: Any) -> jax.Array:
        """Cached K or V ("k" / "v") [B, S, nkv, hd] in `dtype` (dequantised for an int8 cache)."""
        values = getattr(self, name)
        scale = getattr(self, f"{name}_scale")
        if scale is not None:
            return _dequantize_int8(values, scale, dtype)
        if _stored_as_bits(self.dtype):
            values = lax.bitcast_convert_type(values, jnp.dtype(self.dtype))
        return values.astype(dtype)

    def as_read(self, x: jax.Array) -> jax.Array:
        """New K or V `x` [B, T, nkv, hd] as `read` would return it once written (rounded to a
        16-bit cache's dtype, or quantised and dequantised for an int8 one), in x's dtype."""
        if self.k_scale is not None:
            return _dequantize_int8(*_quantize_int8(x), x.dtype)
        if _stored_as_bits(self.dtype):
            return x.astype(self.dtype).astype(x.dtype)
        return x

    def visible(self, kv_len: int | None) -> LayerCache:
        """The first kv_len slots when kv_len is below the slot count. Every position the cache holds
        is < kv_len, so later slots hold nothing yet; on a sliding ring with kv_len <= its slots no
        position has wrapped round, and slot = position there too."""
        if kv_len is None or kv_len >= self.slots:
            return self
        return jax.tree.map(lambda a: a[:, :kv_len], self)

    def take(self, rows: jax.Array | None) -> LayerCache:
        """Rows `rows` [g] (distinct) of this entry (None: all of them, as they are)."""
        return self if rows is None else jax.tree.map(lambda a: a[rows], self)

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array, real: jax.Array, ring: bool,
              rows: jax.Array | None = None) -> LayerCache:
        """Scatter new K/V [B, T, nkv, hd] at absolute `positions` [B, T]; only `real` [B, T] tokens
        are written, and on a ring only the last S real positions of the chunk (no two writes race).
        `rows` [B]: the distinct cache rows the B rows write (None: row b writes cache row b)."""
        slots = self.slots
        keep = real
        if ring:
            last_real = jnp.max(jnp.where(real, positions, -1), axis=1)  # [B]
            keep &= positions > (last_real[:, None] - slots)
            slot = positions % slots
        else:
            slot = positions
        slot = jnp.where(keep, slot, slots)  # out of range -> dropped
        rows = jnp.broadcast_to((jnp.arange(k.shape[0]) if rows is None else rows)[:, None], slot.shape)
        new: dict[str, jax.Array] = {"k": k, "v": v}
        if self.k_scale is not None:
            for name in ("k", "v"):
                new[name], new[f"{name}_scale"] = _quantize_int8(new[name])
        elif _stored_as_bits(self.dtype):
            new = {name: lax.bitcast_convert_type(value.astype(self.dtype), jnp.uint16) for name, value in new.items()}
        updated = {name: getattr(self, name).at[rows, slot].set(value.astype(getattr(self, name).dtype), mode="drop")
                   for name, value in new.items()}
        return dataclasses.replace(self, **updated)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache of every layer, rows = batch slots."""

    layers: tuple[LayerCache | None, ...]

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes the layers hold their values in (bf16 for a bf16 cache stored as bits)."""
        return tuple(sorted({layer.dtype for layer in self.layers if layer is not None}))

    def rows(self, slot: jax.Array, size: int = 1) -> KVCache:
        """Rows [slot, slot + size) of every array (a traced `slot`), as buffers of their own (a row
        computed on alone: batch-invariant decode).

        Sliced plainly, the slice fuses into its consumers (the attention's reads of the past), which
        then read the whole donated cache; writing the rows back (`put_rows`) in place must wait for
        those reads, which nothing orders before it, so XLA:CPU copied every layer's whole cache
        twice instead (a 32-token prefill of the built-in model with 8 slots of 4,096 positions:
        139-140 ms, against 74-94 ms with the rows read through `opaque`, whose result the write
        back depends on; docs/cpu_decode.md)."""
        return opaque(slot >= 0, lambda cache: jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, slot, size, axis=0),
                                                            cache), self)

    def put_rows(self, rows: KVCache, slot: jax.Array) -> KVCache:
        """This cache with `rows` (from `rows`) written back at `slot`."""
        return jax.tree.map(lambda a, r: lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), slot, axis=0),
                            self, rows)

    def gather(self, rows: jax.Array, kv_len: int | None) -> KVCache:
        """Rows `rows` [k], only their first kv_len slots where kv_len is below a layer's slot count
        (every position is below kv_len, so later slots hold nothing yet and a ring has not wrapped)."""
        return jax.tree.map(lambda a: a[rows, _moving(a, kv_len)], self)

    def scatter(self, rows: jax.Array, sub: KVCache, kv_len: int | None) -> KVCache:
        """The inverse of `gather`: `sub` written back into rows `rows`."""
        return jax.tree.map(lambda a, s: a.at[rows, _moving(a, kv_len)].set(s), self, sub)


def _moving(a: jax.Array, kv_len: int | None) -> slice:
    return slice(None, None if kv_len is None else min(kv_len, a.shape[1]))


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32, ring_slack: int = 0) -> KVCache:
    """Zeroed cache for `batch` rows of up to `max_len` positions, values held in `dtype`; sliding rings
    with `ring_slack` extra slots (speculative decoding, module docstring)."""
    dtype = jnp.dtype(dtype)
    layers: list[LayerCache | None] = []
    for spec in config.layers:
        if not spec.owns_kv:
            layers.append(None)
            continue
        shape = (batch, cache_slots(spec, max_len, ring_slack), spec.num_kv_heads, spec.head_dim)
        stored = jnp.uint16 if _stored_as_bits(dtype) else dtype
        scales = {}
        if dtype == jnp.int8:  # per-position, per-head scales [B, S, nkv]
            scales = {"k_scale": jnp.zeros(shape[:3], jnp.float32), "v_scale": jnp.zeros(shape[:3], jnp.float32)}
        layers.append(LayerCache(k=jnp.zeros(shape, stored), v=jnp.zeros(shape, stored), dtype=dtype.name, **scales))
    return KVCache(tuple(layers))


@functools.lru_cache(maxsize=256)
def _layer_bytes(config: ModelConfig, max_len: int, dtype_name: str, ring_slack: int = 0) -> tuple[int, ...]:
    abstract = jax.eval_shape(lambda: init_cache(config, 1, max_len, dtype_name, ring_slack))
    return tuple(0 if layer is None else count_bytes(layer) for layer in abstract.layers)


def layer_cache_bytes(config: ModelConfig, max_len: int, batch: int = 1, dtype: Any = jnp.bfloat16,
                      ring_slack: int = 0) -> tuple[int, ...]:
    """Bytes of each layer's cache (0 for KV-sharing layers), `batch` rows of `max_len` positions."""
    return tuple(batch * size for size in _layer_bytes(config, max_len, jnp.dtype(dtype).name, ring_slack))


def cache_bytes(config: ModelConfig, max_len: int, batch: int = 1, dtype: Any = jnp.bfloat16, ring_slack: int = 0) -> int:
    """Bytes of `init_cache(config, batch, max_len, dtype, ring_slack)`, from `jax.eval_shape` (nothing
    allocated)."""
    return batch * sum(_layer_bytes(config, max_len, jnp.dtype(dtype).name, ring_slack))


def slot_bytes(config: ModelConfig, dtype: Any = jnp.bfloat16) -> tuple[int, ...]:
    """Bytes of one slot of one row, per layer (K, V and their scales); a KV-sharing layer counts its
    donor's slot, the bytes it reads."""
    own = _layer_bytes(config, 1, jnp.dtype(dtype).name)
    return tuple(own[spec.kv_donor] for spec in config.layers)
