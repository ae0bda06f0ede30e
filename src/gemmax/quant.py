"""Load-time quantisation: int8 and W4A16 linear layers, an int8 LM head, 8/4-bit per-layer embeddings.

Options travel as one frozen `QuantOptions` from the CLI through `gemmax.runtime.load_model` into the
loader's `transform` hook: each tensor is quantised as it is read, so peak host memory stays near
the quantised size. The stored forms are registered dataclass pytrees, so params stay a pytree and
`jit`, `eval_shape` and byte counting (`jax.tree.leaves`) keep working; `gemmax.linear.linear` and
`lookup` hand them to `linear` / `lookup` here.

Forms (scales are bfloat16: float32's range in 2 bytes, a 2^-9 relative rounding that is small
next to the quantisation step itself):
- `Int8Weight` W [out, in]: q int8 [out, in], one scale per output channel (W ~ q * scale[:, None]).
- `Int4Weight` W [out, in]: two's-complement 4-bit values, one scale per `group` input columns
  (group 128, or the largest power of two below it that divides the packing), Q4_0-style: the
  group's largest-magnitude value maps to -8. Packed per chunk of at most 4095 columns
  (`packing_chunks`, the same blocks `fastpath.prepare_params` splits matrices into): byte j of a
  chunk of width w holds column j (low nibble) and column w/2 + j (high nibble). Unpacking is then
  two shifts, and each nibble plane is a plain [out, w/2] matrix that XLA:CPU reads inside its fused
  matrix-vector dot (below).
- `QuantizedTable` (the per-layer embedding table, only ever gathered): int8 [V, D] or packed
  uint8 [V, D/2] (byte j = columns 2j | 2j+1 << 4), one scale per group of P columns (one per
  token per layer); `compute_dtype` is the dtype the table had, which the model's scaling uses.
- the int8 LM head is an extra `params["lm_head"]` `Int8Weight` of the tied embedding: the gather
  keeps the table's precision, only the head's matmul reads int8.

How each form is multiplied (`kernel`, chosen at load for the device):
- "cpu" (XLA:CPU, measured in docs/quantization.md on this 2-core Zen 4 under load): one row runs
  the fused matrix-vector form, `(x @ q.astype(f32).T) * scale` for int8 (~19 Gparam/s, about 2x
  the bf16 form) and, for int4, one dot per nibble plane with the group scales multiplied in
  (~9-13 Gparam/s; the bytes are read once per plane). Spellings that unpack into an interleaved
  [out, in] matrix, or reduce rows (`(W * x).sum(-1)`), make XLA materialise or loop (0.1-1 Gparam/s).
  Up to ROW_LOOP_MAX rows (batched decode) run that form row by row, which beats dequantising the
  weight every step; more rows (prefill) dequantise once and use the GEMM. An int8 matrix too big
  for the cache (an LM head) at 4-8 rows is converted tile by tile inside a loop and multiplied by
  the GEMM (`tiled`): read once as int8, each bf16 tile used while it is in cache.
- "xla" (GPU, TPU): dequantise and dot with float32 accumulation; XLA fuses the dequantisation.
- "pallas" / "pallas_interpret": W4A16 through the fused Pallas kernel (gemmax.pallas_w4a16) with
  tiles checked against the device's on-chip memory at start-up; interpret mode is the CPU simulator.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.pallas_w4a16 import W4A16FitError, W4Tiles, check_w4a16_fits, onchip_limit, w4a16_matmul

QUANT_MODES = ("auto", "none", "int8", "w4a16")
PLE_BITS = (16, 8, 4)
KV_CACHE_DTYPES = ("auto", "int8")
W4A16_KERNELS = ("auto", "xla", "pallas")  # what a user asks for; resolved to one of KERNELS
KERNELS = ("xla", "cpu", "pallas", "pallas_interpret")
INT4_GROUP = 128
ROW_LOOP_MAX = 8  # up to this many rows, the CPU form runs row by row (batched decode)
TILED_MIN_ROWS, TILED_MIN_PARAMS = 4, 1 << 24  # int8 matrices this big at this many rows: `tiled`
DEQUANT_TILE_ROWS = 4096  # int8 rows converted at a time for a batched-decode GEMM (4096 x 640 bf16: 5 MB)
CHUNK_ROWS = 8192  # big tables are quantised this many rows at a time (bounded temporaries)
F32 = jnp.float32


class QuantError(ValueError):
    """Quantisation options that cannot run as asked (with the reason)."""


@dataclasses.dataclass(frozen=True)
class QuantOptions:
    """Load-time quantisation of one deployment (docs/quantization.md)."""

    # linear layers: none | int8 (per output channel) | w4a16 (int4, group-wise scales) | auto
    # (`for_source`: int8 layers and LM head for weights that were already stored quantised)
    quant: str = "none"
    ple_bits: int = 16  # per-layer embedding table: 16 (as loaded) | 8 | 4
    int8_lm_head: bool = False  # an int8 copy of the tied embedding for the LM head's matmul
    kv_cache: str = "auto"  # auto (device policy) | int8 (per-position, per-head scales)
    w4a16_kernel: str = "auto"  # auto | xla | pallas; after `resolve`: one of KERNELS
    w4a16_tiles: W4Tiles | None = None  # Pallas tiles (None: the largest that fits)
    allow_pallas_interpret: bool = False  # run the Pallas kernel in CPU interpret mode (a simulator)
    w4a16_probe: str | None = None  # after `resolve` on a live GPU / TPU: "passed" | "failed" (engine.kernel_probe)

    def __post_init__(self):
        for name, value, allowed in (("quant", self.quant, QUANT_MODES), ("ple_bits", self.ple_bits, PLE_BITS),
                                     ("kv_cache", self.kv_cache, KV_CACHE_DTYPES),
                                     ("w4a16_kernel", self.w4a16_kernel, W4A16_KERNELS + KERNELS)):
            if value not in allowed:
                raise QuantError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")

    def for_source(self, quantized_source: bool, dtype_given: bool) -> QuantOptions:
        """Resolve quant="auto" for one checkpoint. A checkpoint whose matrices were already stored at 8
        bits or fewer (a Q4_K_M / Q8_0 GGUF, the built-in model) keeps them as int8 (layers and the LM
        head), as llama.cpp runs such files quantised: batch-1 decode streams half the bytes of bf16
        (docs/real_model.md has the measured speed and the quality cost). Anything else, or an
        explicit `--dtype` (which asks for the dequantised weights at that dtype), loads unquantised."""
        if self.quant != "auto":
            return self
        if quantized_source and not dtype_given:
            return dataclasses.replace(self, quant="int8", int8_lm_head=True)
        return dataclasses.replace(self, quant="none")

    @property
    def changes_weights(self) -> bool:
        return self.quant != "none" or self.ple_bits != 16 or self.int8_lm_head

    @property
    def label(self) -> str:
        """Short name, e.g. 'int8+ple4+int8_lm_head' ('none' when nothing is quantised)."""
        parts = [self.quant] if self.quant != "none" else []
        parts += [f"ple{self.ple_bits}"] if self.ple_bits != 16 else []
        parts += ["int8_lm_head"] if self.int8_lm_head else []
        parts += ["kv_int8"] if self.kv_cache == "int8" else []
        return "+".join(parts) or "none"

    def describe(self) -> str:
        """The policy line's part: what is quantised and how it runs."""
        text = f"quant={self.quant} ple_bits={self.ple_bits} int8_lm_head={self.int8_lm_head}"
        if self.quant == "w4a16":
            text += f" w4a16_kernel={self.w4a16_kernel}"
            if self.w4a16_tiles is not None:
                text += f" w4a16_tiles={self.w4a16_tiles}"
            if self.w4a16_probe is not None:
                text += f" w4a16_probe={self.w4a16_probe}"
        return text


# ------------------------------------------------------------------------------------------- forms


def _static(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    q: jax.Array  # int8 [out, in]
    scale: jax.Array  # bfloat16 [out]
    kernel: str = _static("xla")
    compute_dtype: str = _static("bfloat16")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def __getitem__(self, index) -> Int8Weight:
        """W[:, a:b]: a column block (`fastpath.prepare_params` splits wide matrices); shares the scales."""
        _, cols = index
        return dataclasses.replace(self, q=self.q[:, cols])

    def dequantize(self, dtype: Any = F32) -> jax.Array:
        return (self.q.astype(F32) * self.scale.astype(F32)[:, None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    packed: jax.Array  # uint8 [out, in/2]: per chunk of width w, byte j = column j | column w/2 + j << 4
    scales: jax.Array  # bfloat16 [out, in/group]
    group: int = _static()
    chunks: tuple[int, ...] = _static()  # packing chunk widths, summing to in
    kernel: str = _static("xla")
    tiles: W4Tiles | None = _static(None)
    compute_dtype: str = _static("bfloat16")

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
            q = lax.bitcast_convert_type(packed, jnp.int8)
            lo = (((q << 4) >> 4).astype(F32).reshape(out, groups, self.group) * scales[:, :groups, None]).reshape(out, half)
            hi = ((q >> 4).astype(F32).reshape(out, groups, self.group) * scales[:, groups:, None]).reshape(out, half)
            planes.append((start, width, lo, hi))
            start += width
        return planes

    def dequantize(self, dtype: Any = F32) -> jax.Array:
        return jnp.concatenate([p for _, _, lo, hi in self.planes() for p in (lo, hi)], axis=1).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTable:
    q: jax.Array  # int8 [V, D] (8 bits) or uint8 [V, D/2] (4 bits: byte j = column 2j | column 2j+1 << 4)
    scales: jax.Array  # bfloat16 [V, D/group]
    bits: int = _static()
    group: int = _static()
    compute_dtype: str = _static("bfloat16")  # the table's dtype before quantisation

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1] * (2 if self.bits == 4 else 1))

    def rows(self, ids: jax.Array) -> jax.Array:
        """Dequantised rows [..., D] (float32) of ids [...]."""
        q = jnp.take(self.q, ids, axis=0)
        if self.bits == 4:
            q = lax.bitcast_convert_type(q, jnp.int8)
            q = jnp.stack([(q << 4) >> 4, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
        scales = jnp.take(self.scales, ids, axis=0).astype(F32)  # [..., D/group]
        d = q.shape[-1]
        return (q.astype(F32).reshape(*q.shape[:-1], d // self.group, self.group) * scales[..., None]).reshape(*q.shape)


QUANTIZED = (Int8Weight, Int4Weight, QuantizedTable)


def is_quantized(w: Any) -> bool:
    """A quantised form, or a tuple of column blocks of one (after `fastpath.prepare_params`)."""
    return isinstance(w, QUANTIZED) or (isinstance(w, tuple) and bool(w) and isinstance(w[0], QUANTIZED))


# ------------------------------------------------------------------------------------------- reads


def lookup(table: QuantizedTable, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows of a quantised table for ids [...] -> [..., D] in `dtype`."""
    return table.rows(ids).astype(dtype)


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] times a quantised W [out, in] (or its column blocks) transposed -> [..., out] in x.dtype."""
    blocks = w if isinstance(w, tuple) else (w,)
    lead, k = x.shape[:-1], x.shape[-1]
    if sum(b.shape[1] for b in blocks) != k:
        raise ValueError(f"weight has {sum(b.shape[1] for b in blocks)} inputs but x has {k}")
    x2 = x.reshape(math.prod(lead), k)  # [rows, in]
    kernel = blocks[0].kernel
    if kernel == "cpu" and tiled(x2.shape[0], blocks):
        y = _int8_tiles(x2, blocks)
    elif kernel == "cpu" and x2.shape[0] <= ROW_LOOP_MAX:
        rows = [_gemv(x2[r : r + 1], blocks) for r in range(x2.shape[0])]
        y = rows[0] if len(rows) == 1 else jnp.concatenate(lax.optimization_barrier(rows), axis=0)
    elif kernel in ("pallas", "pallas_interpret"):
        y = _pallas(x2, blocks, interpret=kernel == "pallas_interpret")
    else:
        y = _dequantized_dot(x2, blocks)
    return y.astype(x.dtype).reshape(*lead, y.shape[-1])


def _sum(parts: list[jax.Array]) -> jax.Array:
    if len(parts) == 1:
        return parts[0]
    # An add fused onto a matrix-vector dot makes XLA:CPU copy the weight out (see gemmax.linear).
    parts = lax.optimization_barrier(parts)
    return sum(parts[1:], parts[0])


def _gemv(x: jax.Array, blocks: tuple) -> jax.Array:
    """One row x [1, in] -> [1, out] float32 in XLA:CPU's fused matrix-vector form: the weight's unpack,
    convert and group scales happen inside the dot, so it is read once as stored."""
    # x rounded to the compute dtype, as the plain bf16 path does (x.astype(W.dtype)). The rounding
    # also keeps the vector's producer (final norm, residual add) out of the dot's fusion: fused into
    # the vector side it made the int8 LM head 2-4x slower (measured on the E2B-shaped decode step).
    from gemmax.linear import flat_vector  # gemmax.linear imports this module

    x = flat_vector(x.astype(blocks[0].compute_dtype).astype(F32))  # a plain row (see there)
    parts, start = [], 0
    for b in blocks:
        if isinstance(b, Int8Weight):
            parts.append(x[:, start : start + b.shape[1]] @ b.q.astype(F32).T)
        else:
            for chunk_start, width, lo, hi in b.planes():
                c = start + chunk_start
                parts.append(x[:, c : c + width // 2] @ lo.T)
                parts.append(x[:, c + width // 2 : c + width] @ hi.T)
        start += b.shape[1]
    y = _sum(parts)
    if isinstance(blocks[0], Int8Weight):
        y = y * blocks[0].scale.astype(F32)
    return y


def tiled(rows: int, blocks: tuple) -> bool:
    """Whether the CPU kernel multiplies `rows` rows by these int8 blocks through `_int8_tiles`
    rather than row by row. Measured on the built-in model's decode step (its 168 MB int8 LM head;
    the other matrices fit in cache, where the row loop re-reads them cheaply): batch 8 91 -> 65 ms,
    batch 4 47 -> 37 ms, batch 2 22 -> 24 ms (slower: two rows read the head only twice)."""
    return (TILED_MIN_ROWS <= rows <= ROW_LOOP_MAX and isinstance(blocks[0], Int8Weight)
            and sum(math.prod(b.shape) for b in blocks) >= TILED_MIN_PARAMS)


def _tile_rows(n: int) -> int:
    """Output rows dequantised at a time: the largest divisor of n up to DEQUANT_TILE_ROWS (n if none
    of at least 64 rows exists)."""
    for count in range(-(-n // DEQUANT_TILE_ROWS), n // 64 + 1):
        if n % count == 0:
            return n // count
    return n


def _int8_tiles(x: jax.Array, blocks: tuple) -> jax.Array:
    """x [rows, in] (a few rows: batched decode) @ W.T for an int8 W (or its column blocks) -> [rows, out]
    float32: a loop over tiles of output rows, each converted to the compute dtype (exact: |q| <= 127)
    and multiplied by XLA:CPU's GEMM (`gemmax.linear`), scales applied after. The weight is read once
    as int8; its bf16 tile (at most DEQUANT_TILE_ROWS x in) stays in cache for the GEMM."""
    from gemmax.linear import linear  # gemmax.linear imports this module

    dtype = blocks[0].compute_dtype
    parts, start = [], 0
    for b in blocks:
        n, k = b.shape
        xs = x[:, start : start + k]
        tile = _tile_rows(n)
        _, ys = lax.scan(lambda carry, q, xs=xs: (carry, linear(xs, q.astype(dtype)).astype(F32)), None,
                         b.q.reshape(n // tile, tile, k))  # ys [n / tile, rows, tile]
        parts.append(ys.transpose(1, 0, 2).reshape(x.shape[0], n))
        start += k
    return sum(parts[1:], parts[0]) * blocks[0].scale.astype(F32)


def _dequantized_dot(x: jax.Array, blocks: tuple) -> jax.Array:
    """x [rows, in] @ W.T with W dequantised to the compute dtype, float32 accumulation (the XLA path)."""
    dtype = blocks[0].compute_dtype
    dims = (((1,), (1,)), ((), ()))
    if isinstance(blocks[0], Int8Weight):
        q = jnp.concatenate([b.q for b in blocks], axis=1) if len(blocks) > 1 else blocks[0].q
        y = lax.dot_general(x.astype(dtype), q.astype(dtype), dims, preferred_element_type=F32)
        return y * blocks[0].scale.astype(F32)
    w = jnp.concatenate([b.dequantize(dtype) for b in blocks], axis=1) if len(blocks) > 1 else blocks[0].dequantize(dtype)
    return lax.dot_general(x.astype(dtype), w, dims, preferred_element_type=F32)


def _pallas(x: jax.Array, blocks: tuple, interpret: bool) -> jax.Array:
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


# ------------------------------------------------------------------------------------------- quantisers


def packing_chunks(k: int) -> tuple[int, ...]:
    """Widths of an int4 matrix's packing chunks: `linear.column_blocks(k)` (each <= 4095, even)."""
    from gemmax.linear import column_blocks

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


@jax.jit
def _int8_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per row: w [R, C] -> (q int8 [R, C], scale bfloat16 [R]); q from the rounded scale."""
    wf = w.astype(F32)
    scale = (jnp.max(jnp.abs(wf), axis=-1) / 127.0).astype(jnp.bfloat16)
    s = scale.astype(F32)
    q = jnp.round(wf / jnp.where(s > 0, s, 1.0)[:, None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


@functools.partial(jax.jit, static_argnames=("bits", "group"))
def _grouped(w: jax.Array, bits: int, group: int) -> tuple[jax.Array, jax.Array]:
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


def _nibbles(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Two int8 arrays of values in [-8, 7] -> one uint8 array (lo in the low nibble)."""
    return (lo.astype(jnp.uint8) & 15) | (hi.astype(jnp.uint8) << 4)


@functools.partial(jax.jit, static_argnames=("chunks",))
def _pack_matrix(q: jax.Array, chunks: tuple[int, ...]) -> jax.Array:
    parts, start = [], 0
    for width in chunks:
        parts.append(_nibbles(q[:, start : start + width // 2], q[:, start + width // 2 : start + width]))
        start += width
    return jnp.concatenate(parts, axis=1)


@jax.jit
def _pack_pairs(q: jax.Array) -> jax.Array:
    return _nibbles(q[:, 0::2], q[:, 1::2])


def _by_rows(fn: Callable, w: jax.Array) -> tuple[jax.Array, ...]:
    """fn over row chunks of w, outputs concatenated: big tables never need f32 temporaries of their full size."""
    if w.shape[0] <= CHUNK_ROWS:
        return fn(w)
    outs = [fn(w[i : i + CHUNK_ROWS]) for i in range(0, w.shape[0], CHUNK_ROWS)]
    return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*outs, strict=True))


def _dtype_name(w: Any) -> str:
    return jnp.dtype(w.dtype).name


def quantize_int8(w: jax.Array, kernel: str = "xla") -> Int8Weight:
    """W [out, in] -> int8 per output channel."""
    q, scale = _by_rows(_int8_rows, w)
    return Int8Weight(q, scale, kernel=kernel, compute_dtype=_dtype_name(w))


def quantize_int4(w: jax.Array, kernel: str = "xla", tiles: W4Tiles | None = None) -> Int4Weight:
    """W [out, in] -> int4 with group-wise scales, packed per chunk (see the module docstring)."""
    chunks, group = packing_chunks(w.shape[1]), int4_group(w.shape[1])
    q, scales = _by_rows(functools.partial(_grouped, bits=4, group=group), w)
    return Int4Weight(_pack_matrix(q, chunks), scales, group=group, chunks=chunks, kernel=kernel, tiles=tiles,
                      compute_dtype=_dtype_name(w))


def quantize_table(table: jax.Array, bits: int, group: int) -> QuantizedTable:
    """An embedding table [V, D] -> 8 or 4 bits with one scale per `group` columns."""
    if bits not in (8, 4) or table.shape[1] % group or (bits == 4 and group % 2):
        raise QuantError(f"cannot quantise a table of {table.shape[1]} columns to {bits} bits in groups of {group}")

    def fn(rows):
        q, scales = _grouped(rows, bits=bits, group=group)
        return (_pack_pairs(q) if bits == 4 else q), scales

    q, scales = _by_rows(fn, table)
    return QuantizedTable(q, scales, bits=bits, group=group, compute_dtype=_dtype_name(table))


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """The loader's `transform(spec, value)` and the step after loading (`finish`), for one option set
    (resolve them for the device with `resolve`; unresolved "auto" means the XLA form `kernel`)."""

    options: QuantOptions
    kernel: str = "xla"  # the device's XLA form ("cpu" on CPU): int8, and w4a16 when not resolved to another
    ple_group: int = 0  # hidden_size_per_layer_input: one scale per token per layer of the PLE table

    @classmethod
    def for_config(cls, options: QuantOptions, config, kernel: str = "xla") -> Quantizer:
        return cls(options, kernel, config.hidden_size_per_layer_input)

    def transform(self, spec, value: jax.Array) -> Any:
        o = self.options
        if spec.kind == "matrix" and o.quant == "int8":
            return quantize_int8(value, self.kernel)
        if spec.kind == "matrix" and o.quant == "w4a16":
            if o.w4a16_kernel == "pallas" and o.w4a16_tiles is None:
                raise QuantError("w4a16_kernel='pallas' needs tiles for the device: pass the options through resolve()")
            kernel = self.kernel if o.w4a16_kernel == "auto" else o.w4a16_kernel
            return quantize_int4(value, kernel, o.w4a16_tiles)
        if spec.path == ("ple_embed",) and o.ple_bits != 16:
            return quantize_table(value, o.ple_bits, self.ple_group)
        return value

    def finish(self, params: dict[str, Any]) -> dict[str, Any]:
        """Add what is not a transform of one tensor: the int8 LM head (a copy of the tied embedding)."""
        if self.options.int8_lm_head:
            return {**params, "lm_head": quantize_int8(params["embed"], self.kernel)}
        return params


def quantize_params(params: dict[str, Any], config, options: QuantOptions, kernel: str = "xla") -> dict[str, Any]:
    """Quantise loaded params (arrays, or ShapeDtypeStructs under `jax.eval_shape`)."""
    from gemmax.params import map_params

    quantizer = Quantizer.for_config(options, config, kernel)
    return quantizer.finish(map_params(params, config, quantizer.transform))


# ------------------------------------------------------------------------------------------- device plan


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """Options with concrete kernels for one device, and what the log should say about them."""

    options: QuantOptions
    kernel: str  # the XLA form for this platform: "cpu" or "xla"
    note: str | None = None  # the W4A16 tile arithmetic, or why the XLA path was chosen

    def quantizer(self, config) -> Quantizer:
        return Quantizer.for_config(self.options, config, self.kernel)


def resolve(options: QuantOptions, platform: str, compute_capability: str | None = None, config=None,
            probe: Callable | None = None) -> QuantPlan:
    """Choose the kernels for the live device. W4A16 on GPU/TPU uses the Pallas kernel with tiles that
    fit the on-chip memory per block (explicit tiles that do not fit are refused with the arithmetic)
    and, given `probe` (tiles, chunk shapes -> gemmax.engine.kernel_probe.ProbeResult, run on the live device),
    only once the probe compiled it and matched the XLA path: else "auto" falls back to XLA and an
    explicit "pallas" is refused ("auto" also falls back when the probe timed it slower than XLA); on CPU the measured XLA form, or the Pallas kernel in interpret
    mode only when explicitly allowed."""
    if options.quant == "auto":
        raise QuantError("quant='auto' depends on the checkpoint: resolve it with QuantOptions.for_source first")
    kernel = "cpu" if platform == "cpu" else "xla"
    if options.quant != "w4a16":
        return QuantPlan(options, kernel)
    asked, tiles = options.w4a16_kernel, options.w4a16_tiles
    if asked in KERNELS and asked != "pallas":  # already resolved
        return QuantPlan(options, kernel)
    if asked == "xla" or (platform == "cpu" and asked == "auto"):
        return QuantPlan(dataclasses.replace(options, w4a16_kernel="cpu" if asked == "auto" else "xla"), kernel)
    if config is None:
        raise QuantError("the W4A16 Pallas kernel needs the model config to check its tiles")
    if platform == "cpu":
        if not options.allow_pallas_interpret:
            raise QuantError(
                "--w4a16-kernel pallas on CPU runs Pallas in interpret mode (pallas_interpret=True), a simulator "
                "thousands of times slower than the XLA path: refusing to serve with it; pass "
                "--allow-pallas-interpret to run it anyway (tests, debugging)")
        fit = check_w4a16_fits(config, tiles, device_limit=1 << 62, platform="cpu")
        return QuantPlan(dataclasses.replace(options, w4a16_kernel="pallas_interpret", w4a16_tiles=fit.tiles),
                         kernel, "Pallas W4A16 kernel in interpret mode (simulated on CPU)")
    from gemmax.pallas_w4a16 import describe_fit

    limit = onchip_limit(platform, compute_capability)
    try:
        fit = check_w4a16_fits(config, tiles, limit, platform=platform)
    except W4A16FitError as exc:
        if asked == "auto" and tiles is None:
            return QuantPlan(dataclasses.replace(options, w4a16_kernel="xla"), kernel,
                             f"no Pallas tiling fits, using the XLA W4A16 path: {exc}")
        raise
    note = describe_fit(fit)
    if probe is not None:
        result = probe(fit.tiles, tuple(b.shape for b in fit.blocks))
        slower = result.ok and result.speedup is not None and result.speedup < 1
        options = dataclasses.replace(options, w4a16_probe="failed" if not result.ok else "slower" if slower else "passed")
        if slower and asked == "auto":
            return QuantPlan(dataclasses.replace(options, w4a16_kernel="xla"), kernel,
                             f"the Pallas W4A16 kernel passed its start-up probe but ran at {result.speedup:.2f}x the "
                             f"XLA path's speed, using the XLA W4A16 path (--w4a16-kernel pallas forces it): {result.detail}")
        if not result.ok and asked == "auto":
            return QuantPlan(dataclasses.replace(options, w4a16_kernel="xla"), kernel,
                             f"the Pallas W4A16 kernel failed its start-up probe on this device, using the XLA "
                             f"W4A16 path: {result.detail}")
        if not result.ok:
            raise QuantError(f"--w4a16-kernel pallas: the kernel failed its start-up probe on this device: {result.detail}")
        note += f"; start-up probe passed: {result.detail}"
    return QuantPlan(dataclasses.replace(options, w4a16_kernel="pallas", w4a16_tiles=fit.tiles), kernel, note)


# ------------------------------------------------------------------------------------------- bytes

# The option sets `gemmax fit` lists (weights only: the KV cache option does not change them).
BYTES_TABLE = {
    "none": QuantOptions(),
    "int8": QuantOptions(quant="int8"),
    "w4a16": QuantOptions(quant="w4a16"),
    "ple8": QuantOptions(ple_bits=8),
    "ple4": QuantOptions(ple_bits=4),
    "int8_lm_head": QuantOptions(int8_lm_head=True),
    "ple4+int8_lm_head": QuantOptions(ple_bits=4, int8_lm_head=True),
    "int8+ple4+int8_lm_head": QuantOptions(quant="int8", ple_bits=4, int8_lm_head=True),
    "w4a16+ple4+int8_lm_head": QuantOptions(quant="w4a16", ple_bits=4, int8_lm_head=True),
}


def quantized_weight_bytes(config, options: QuantOptions, weight_dtype: Any = jnp.bfloat16) -> int:
    """Exact bytes of the params a load with `options` keeps, from shapes alone (`jax.eval_shape`)."""
    from gemmax.params import abstract_params, count_bytes

    shapes = jax.eval_shape(lambda p: quantize_params(p, config, options), abstract_params(config, weight_dtype))
    return count_bytes(shapes)


def weight_bytes_table(config, weight_dtype: Any = jnp.bfloat16) -> dict[str, int]:
    """{option label: weight bytes} for the option sets of BYTES_TABLE (PLE options only with a PLE table)."""
    return {label: quantized_weight_bytes(config, options, weight_dtype) for label, options in BYTES_TABLE.items()
            if options.ple_bits == 16 or config.hidden_size_per_layer_input}


def format_weight_bytes(table: dict[str, int], weight_dtype: Any = jnp.bfloat16) -> str:
    base = table["none"]
    lines = [f"weight bytes by quantisation option ({jnp.dtype(weight_dtype).name} otherwise, norms float32):"]
    for label, n in table.items():
        lines.append(f"  {label:26s} {n:>16,} B  {n / (1 << 30):7.3f} GiB  {n / base:6.1%}")
    return "\n".join(lines)
