"""A fused W4A16 matmul in Pallas, and the check that its tiles fit the device's on-chip memory.

The kernel computes y [M, N] = x [M, K] @ W.T for one packing chunk of an `Int4Weight`
(gemmax.quant.w4a16, laid out as gemmax.quant.packing says: K <= 4095 columns; byte j of row n holds
column j in its low nibble and column K/2 + j in its high nibble, two's-complement int4; one
bfloat16 scale per `group` columns). `W4Tiles` (gemmax.quant.options) names its block. Each program of the grid
(M / bm, N / bn) owns one [bm, bn] output block: it walks K in steps of `bk` columns (bk/2 packed
bytes, bk/2 from each nibble plane), unpacks and scales the weight tile in registers, multiplies it
with the matching x columns and accumulates in float32. The weight is read once, as 4-bit data.

Why the fit check exists. A deployment tiled this kernel for TPU (16 MiB of scoped VMEM per core):
blocks of 550 KiB to 1.1 MiB. A GPU block gets its shared memory from a far smaller pool (64 KiB
per block on SM 7.5, opt-in), so the same tiles fail inside the compiler with a bare
OutOfResources long after start-up. `check_w4a16_fits` does the arithmetic first, for every
weight shape of the model: per block,

    stages * (x tile bm*bk*itemsize + packed tile bn*bk/2 + scales bn*(bk/group)*2)
    + fp32 accumulator bm*bn*4 + output bm*bn*itemsize

against the device's limit, and either returns tiles that fit (explicit ones, or the largest fitting
candidate) or raises `W4A16FitError` with the numbers. On TPU the Pallas pipeline copies each
operand's whole block (the full K extent of a chunk) into VMEM, so there the K step counted is the
chunk width.

On CPU, Pallas runs only in interpret mode, a simulator (correct, and far slower than XLA): the
tests use it to check the kernel against the XLA reference; serving refuses it unless allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemmax.model.params import param_specs
from gemmax.quant.options import W4Tiles
from gemmax.quant.packing import int4_group, packing_chunks

KiB = 1024

# Largest shared memory one thread block may use with the opt-in attribute, by compute capability
# (CUDA programming guide, "Technical specifications per compute capability").
SMEM_PER_BLOCK = {"7.5": 64 * KiB, "8.0": 163 * KiB, "8.6": 99 * KiB, "8.9": 99 * KiB, "9.0": 227 * KiB}
SMEM_DEFAULT = 48 * KiB  # any other GPU: the limit without opt-in
TPU_SCOPED_VMEM = 16 * 1024 * KiB  # the default scoped VMEM limit of a TPU core


# What the TPU deployment used (and what a port to a GPU would naively keep).
TPU_TILES = W4Tiles(bm=16, bn=512, bk=2048, stages=2)
# Candidates for automatic selection (`check_w4a16_fits` picks among those that fit).
CANDIDATES = tuple(W4Tiles(bm, bn, bk) for bm in (16, 32, 64) for bn in (32, 64, 128, 256, 512)
                   for bk in (256, 512, 1024, 2048))


class W4A16FitError(ValueError):
    """The W4A16 tiles do not fit the device's on-chip memory; the message carries the arithmetic."""


def onchip_limit(platform: str, compute_capability: str | None = None) -> int | None:
    """Bytes one kernel block may use on chip: opt-in shared memory per block on CUDA GPUs, scoped VMEM
    on TPU; None on CPU (interpret mode has no on-chip memory)."""
    if platform == "gpu":
        return SMEM_PER_BLOCK.get(compute_capability or "", SMEM_DEFAULT)
    if platform == "tpu":
        return TPU_SCOPED_VMEM
    return None


@dataclasses.dataclass(frozen=True)
class BlockBytes:
    """On-chip bytes of one kernel block for one weight shape."""

    shape: tuple[int, int]  # (N, K chunk) of the weight
    names: tuple[str, ...]  # the model's matrices with this shape, e.g. ("layers.0.gate", ...)
    tiles: W4Tiles
    k_step: int  # input columns staged per step
    x: int
    packed: int
    scales: int
    accumulator: int
    output: int

    @property
    def total(self) -> int:
        return self.tiles.stages * (self.x + self.packed + self.scales) + self.accumulator + self.output

    def arithmetic(self) -> str:
        t = self.tiles
        return (f"{t.stages} stages x (x {self.x:,} + packed {self.packed:,} + scales {self.scales:,}) + "
                f"accumulator {self.accumulator:,} + output {self.output:,} = {self.total:,} B ({self.total / KiB:.1f} KiB)")


def effective_tiles(shape: tuple[int, int], tiles: W4Tiles, group: int) -> tuple[int, int]:
    """(bn, K step) the kernel uses on a chunk of `shape` = (N, K): bn is the largest divisor of N
    within tiles.bn that divides bn (a power of two stays one); the K step is the largest multiple of
    2 x group (one group from each nibble plane) that divides K and stays within tiles.bk."""
    n, k = shape
    unit = 2 * group
    steps = k // unit
    cap = max(1, tiles.bk // unit)
    return math.gcd(n, tiles.bn), unit * max(d for d in range(1, min(steps, cap) + 1) if steps % d == 0)


def block_bytes(shape: tuple[int, int], tiles: W4Tiles, group: int, x_itemsize: int = 2, out_itemsize: int = 2,
                whole_k: bool = False, names: tuple[str, ...] = ()) -> BlockBytes:
    """Per-block bytes of the kernel on a weight chunk of `shape` = (N, K) with `tiles` (`whole_k`: the
    streamed blocks span the chunk's K, as TPU's pipeline copies them)."""
    bn, k_step = effective_tiles(shape, tiles, group)
    if whole_k:
        k_step = shape[1]
    return BlockBytes(shape=shape, names=names, tiles=tiles, k_step=k_step, x=tiles.bm * k_step * x_itemsize,
                      packed=bn * k_step // 2, scales=bn * (k_step // group) * 2, accumulator=tiles.bm * bn * 4,
                      output=tiles.bm * bn * out_itemsize)


def w4a16_shapes(config) -> dict[tuple[int, int, int], tuple[str, ...]]:
    """{(N, K chunk, group): matrix names} for every matrix an `Int4Weight` stores, chunked as
    gemmax.quant.packing packs it."""
    shapes: dict[tuple[int, int, int], list[str]] = {}
    for spec in param_specs(config):
        if spec.kind == "matrix":
            n, k = spec.shape
            for width in packing_chunks(k):
                shapes.setdefault((n, width, int4_group(k)), []).append(".".join(map(str, spec.path)))
    return {key: tuple(names) for key, names in sorted(shapes.items())}


@dataclasses.dataclass(frozen=True)
class W4A16Fit:
    tiles: W4Tiles
    limit: int
    blocks: tuple[BlockBytes, ...]  # one per weight shape

    @property
    def largest(self) -> BlockBytes:
        return max(self.blocks, key=lambda b: b.total)


def check_w4a16_fits(config, tiles: W4Tiles | None, device_limit: int, platform: str = "gpu",
                     x_itemsize: int = 2, out_itemsize: int = 2) -> W4A16Fit:
    """The tiles to use for this model's W4A16 matrices on a device with `device_limit` on-chip bytes
    per block. Explicit `tiles` are checked (W4A16FitError with the arithmetic when a block does not
    fit); with `tiles=None` the fitting candidate with the largest weight tile is chosen. Tiles are upper bounds: on each
    shape the kernel uses the largest bn and K step within them that divide it (`effective_tiles`)."""
    shapes = w4a16_shapes(config)

    def blocks(t: W4Tiles) -> list[BlockBytes]:
        return [block_bytes((n, k), t, group, x_itemsize, out_itemsize, platform == "tpu", names)
                for (n, k, group), names in shapes.items()]

    def problems(t: W4Tiles) -> list[str]:
        out = []
        for b in blocks(t):
            if b.total > device_limit:
                more = f" (+{len(b.names) - 1} more)" if len(b.names) > 1 else ""
                out.append(f"{b.names[0]}{more} [N={b.shape[0]}, K={b.shape[1]}]: {b.arithmetic()} > limit {device_limit:,} B")
        return out

    if tiles is not None:
        found = problems(tiles)
        if found:
            raise W4A16FitError(
                f"W4A16 tiles {tiles} (bm x bn x bk x stages) do not fit this device's on-chip memory per block "
                f"({device_limit:,} B = {device_limit / KiB:.0f} KiB); refusing now instead of failing inside the "
                "kernel compiler:\n  " + "\n  ".join(found) + "\nuse smaller tiles, or let gemmax choose (no --w4a16-tiles)")
        return W4A16Fit(tiles, device_limit, tuple(blocks(tiles)))
    fitting = [t for t in CANDIDATES if not problems(t)]
    if not fitting:
        smallest = min(CANDIDATES, key=lambda t: max(b.total for b in blocks(t)))
        raise W4A16FitError(
            f"no W4A16 tiling fits {device_limit:,} B of on-chip memory per block; the smallest candidate {smallest}:\n  "
            + "\n  ".join(problems(smallest)))
    # The largest weight tile (fewest programs, each x tile reused the most), then the most rows.
    best = max(fitting, key=lambda t: (t.bn * t.bk, t.bm))
    return W4A16Fit(best, device_limit, tuple(blocks(best)))


# ------------------------------------------------------------------------------------------- kernel


def _kernel(xlo_ref, xhi_ref, packed_ref, slo_ref, shi_ref, out_ref, *, k_step: int, group: int, unrolled: bool):
    """One [bm, bn] output block: accumulate over the chunk's K in steps of k_step columns
    (k_step/2 from each nibble plane), each group of `group` columns scaled once. `unrolled`: the
    steps as a Python loop (every index static) instead of `fori_loop`, for Mosaic (TPU), which must
    prove each scale column's offset aligned at compile time and cannot with a loop index (its error
    E2003 on a v5e); compiling the unrolled steps is slower (the TPU probe: 124 s)."""
    half = k_step // 2
    bm, bn = out_ref.shape

    def step(s, acc):
        for g in range(half // group):  # static: groups inside one step
            cols = pl.ds(s * half + g * group, group)
            # Nibbles unpacked in int32: Mosaic cannot shift int8 vectors ("failed to legalize arith.shli").
            q = lax.bitcast_convert_type(packed_ref[:, cols], jnp.int8).astype(jnp.int32)  # [bn, group]
            gcol = pl.ds(s * (half // group) + g, 1)
            lo = ((q << 28) >> 28).astype(jnp.float32) * slo_ref[:, gcol].astype(jnp.float32)  # [bn, group]
            hi = (q >> 4).astype(jnp.float32) * shi_ref[:, gcol].astype(jnp.float32)
            xlo, xhi = xlo_ref[:, cols], xhi_ref[:, cols]  # [bm, group]
            acc += lax.dot_general(xlo, lo.astype(xlo.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            acc += lax.dot_general(xhi, hi.astype(xhi.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    steps = xlo_ref.shape[1] // half
    acc = jnp.zeros((bm, bn), jnp.float32)
    if unrolled:
        for s in range(steps):
            acc = step(s, acc)
    else:
        acc = lax.fori_loop(0, steps, step, acc)
    out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group", "tiles", "interpret", "unrolled"))
def w4a16_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, *, group: int, tiles: W4Tiles,
                 interpret: bool = False, unrolled: bool | None = None) -> jax.Array:
    """x [M, K] @ W.T -> [M, N] float32 for one chunk: packed uint8 [N, K/2] (low nibble: column j, high:
    column K/2 + j), scales [N, K/group]. M is padded to a multiple of bm. `unrolled` (`_kernel`):
    None unrolls where Mosaic compiles the kernel (a TPU backend, not interpret mode)."""
    m, k = x.shape
    n, half = packed.shape
    if k != 2 * half or scales.shape != (n, k // group):
        raise ValueError(f"x [{m}, {k}], packed {packed.shape} and scales {scales.shape} do not describe one chunk")
    bm, (bn, k_step) = tiles.bm, effective_tiles((n, k), tiles, group)
    rows = -(-m // bm) * bm
    x = jnp.pad(x, ((0, rows - m), (0, 0)))
    xlo, xhi = x[:, :half], x[:, half:]
    slo, shi = scales[:, : half // group], scales[:, half // group :]
    if unrolled is None:  # Mosaic compiles it
        unrolled = not interpret and jax.default_backend() == "tpu"
    call = pl.pallas_call(
        functools.partial(_kernel, k_step=k_step, group=group, unrolled=unrolled),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        grid=(rows // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, half), lambda i, j: (j, 0)),
            pl.BlockSpec((bn, half // group), lambda i, j: (j, 0)),
            pl.BlockSpec((bn, half // group), lambda i, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
    )
    return call(xlo, xhi, packed, slo, shi)[:m]


def describe_fit(fit: W4A16Fit) -> str:
    b = fit.largest
    return f"W4A16 tiles {fit.tiles}: largest block {b.total:,} B of {fit.limit:,} B ({b.shape[0]}x{b.shape[1]}: {b.arithmetic()})"

