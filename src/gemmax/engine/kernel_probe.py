"""Start-up probe of the W4A16 Pallas kernel: compile it on the live device with the tiles gemmax would
use and check it against the XLA dequantise path before any deployment relies on it.

A GPU or TPU gets the Pallas kernel by default only when this probe passes; otherwise (a compiler
error, a Mosaic / Triton lowering gap, a wrong answer) gemmax uses the XLA path and the policy line
says `w4a16_probe=failed` with the reason logged. A kernel that passes but runs slower than the XLA
path at one row (decode) is not chosen by default either (`w4a16_probe=slower`): on an H200 it ran
decode of the E2B-shaped model at a quarter of XLA's speed (docs/gpu.md); `--w4a16-kernel pallas`
still forces it. The probe multiplies one block of rows by a random
weight of every packing-chunk shape (N, K) of the model, in the compute dtype, and compares with `Int4Weight.dequantize` + dot (both accumulate in float32 from the same bf16
tiles, so they agree to rounding). It costs one compile per chunk shape, once per process: about 20 s
on an H200; 124 s on a TPU v5e, where the kernel's K steps are unrolled for Mosaic (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
import functools

from gemmax.model.linear import linear
from gemmax.quant.packing import int4_group
from gemmax.quant.pallas_w4a16 import effective_tiles
from gemmax.quant.w4a16 import quantize_int4

TOLERANCE = 2e-2  # max |pallas - xla| / max |xla|


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    ok: bool  # compiled and agreed with the XLA path
    detail: str  # "max error 3.4e-03 of max |y| with tiles ... on 128x256, ..." or the exception
    speedup: float | None = None  # XLA time / Pallas time over the probe's shapes at one row (None: not timed)


def probe_shapes(tiles, chunks, group: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """(M, N, K) per distinct block the model's packing chunks (N, K) give the kernel: one block of rows
    (tiles.bm) times one block column (the bn the kernel uses on that N) of the chunk's full K, so
    every BlockSpec the model will use is compiled once (the grid only repeats it)."""
    blocks = {(effective_tiles((n, k), tiles, group or int4_group(k))[0], k) for n, k in chunks}
    return tuple((tiles.bm, n, k) for n, k in sorted(blocks))


def _seconds(fn, *args, repeats: int = 20) -> float:
    import statistics
    import time

    import jax

    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


@functools.cache
def probe_w4a16(tiles, chunks: tuple[tuple[int, int], ...], interpret: bool = False,
                dtype: str = "bfloat16", timed: bool | None = None) -> ProbeResult:
    """Compile and run the kernel with `tiles` on every (N, K) chunk shape on the default device
    (`interpret`: the CPU simulator, for tests) against the XLA path, then (`timed`, default: when
    compiled for real) time both at one row, decode's shape; never raises."""
    timed = not interpret if timed is None else timed
    try:
        import jax
        import jax.numpy as jnp

        worst, key, xla_s, pallas_s = 0.0, jax.random.key(0), 0.0, 0.0
        shapes = probe_shapes(tiles, chunks)
        if not shapes:
            return ProbeResult(False, "no W4A16 matrix shapes to probe")
        for i, (m, n, k) in enumerate(shapes):
            w = jax.random.normal(jax.random.fold_in(key, 2 * i), (n, k), dtype) * (k**-0.5)
            x = jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (m, k), dtype)
            reference = quantize_int4(w, "xla")
            kernel = dataclasses.replace(reference, kernel="pallas_interpret" if interpret else "pallas", tiles=tiles)
            want = jax.jit(linear)(x, reference).astype(jnp.float32)
            got = jax.jit(linear)(x, kernel).astype(jnp.float32)
            err = float(jnp.abs(got - want).max() / jnp.maximum(jnp.abs(want).max(), 1e-30))
            if not err <= TOLERANCE:  # also catches NaN
                return ProbeResult(False, f"wrong result: max error {err:.1e} of max |y| > {TOLERANCE} with tiles "
                                          f"{tiles} on M={m}, N={n}, K={k}")
            worst = max(worst, err)
        # Speed at one row on the widest weight of each K (the grid of a real matrix, not one block column).
        widest = {k: n for n, k in sorted(chunks)}  # K -> largest N
        for i, (k, n) in enumerate(sorted(widest.items()) if timed else ()):
            w = jax.random.normal(jax.random.fold_in(key, 1000 + i), (n, k), dtype) * (k**-0.5)
            x = jax.random.normal(jax.random.fold_in(key, 2000 + i), (1, k), dtype)
            reference = quantize_int4(w, "xla")
            kernel = dataclasses.replace(reference, kernel="pallas_interpret" if interpret else "pallas", tiles=tiles)
            xla_s += _seconds(jax.jit(linear), x, reference)
            pallas_s += _seconds(jax.jit(linear), x, kernel)
        dims = ", ".join(f"{n}x{k}" for _, n, k in shapes)
        detail = f"max error {worst:.1e} of max |y| with tiles {tiles} on {dims}"
        if not timed:
            return ProbeResult(True, detail)
        speedup = xla_s / pallas_s
        return ProbeResult(True, f"{detail}; one row: Pallas {pallas_s * 1e6:.0f} us, XLA {xla_s * 1e6:.0f} us",
                           speedup)
    except Exception as exc:  # any compile or runtime failure means: do not use the kernel
        text = " ".join(str(exc).split())
        return ProbeResult(False, f"{type(exc).__name__}: {text[:500]}")


def live_probe(platform: str):
    """The probe `gemmax.quant.resolve` runs for the live device: the compiled kernel on GPU / TPU; None
    on CPU, where the kernel runs only in interpret mode and only when explicitly allowed."""
    return probe_w4a16 if platform in ("gpu", "tpu") else None
