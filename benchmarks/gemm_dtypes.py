"""The CPU's matrix-product rate by operand dtype: is int8 x int8 (W8A8) a lever for prefill here?

A prefill chunk already runs its bf16 GEMMs near this CPU's measured peak (`gemmax profile --prefill`),
so only cheaper arithmetic would shorten it. AVX-512 VNNI multiplies bytes (unsigned by signed) at
twice the bf16 rate in hardware; whether XLA:CPU's int8 dot (`preferred_element_type=int32`) gets
there is what this measures, at the built-in model's (Gemma 3 270M) shapes: a 512-token chunk's
projections (640 -> 1024, 640 -> 2048, 2048 -> 640), and the same and the LM head (640 -> 262,144)
at 8 rows, a batch-8 decode step's. Per shape, bfloat16 x bfloat16 -> float32 and int8 x int8 ->
int32, one jitted product each, in two orientations: the activation on the left (`x @ W`, W [K, N])
and the weight on the left (`W @ x.T`, W [N, K], the form gemmax's linear layers use from 8 rows on
CPU: docs/measurements.md, "32-row products with the weight on the left"). Each call is waited for on its own, so
an 8-row product's time includes one dispatch (tens of microseconds), which pulls its ratios toward
1; the same matrix is read by every call, so it may stay in cache where a decode step reads it from
memory. Rounds interleave the cases; median ms over the calls of every round, and the rate (2 M K N
operations per call).

    python benchmarks/gemm_dtypes.py [--rounds 7] [--calls 5]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # name: (rows M, in K, out N)
    "chunk 512: q 640 -> 1024": (512, 640, 1024),
    "chunk 512: gate/up 640 -> 2048": (512, 640, 2048),
    "chunk 512: down 2048 -> 640": (512, 2048, 640),
    "decode 8 rows: q 640 -> 1024": (8, 640, 1024),
    "decode 8 rows: gate/up 640 -> 2048": (8, 640, 2048),
    "decode 8 rows: down 2048 -> 640": (8, 2048, 640),
    "decode 8 rows: LM head 640 -> 262144": (8, 640, 262144),
}
DTYPES = {  # name: (operand dtype, accumulation dtype)
    "bfloat16": (jnp.bfloat16, jnp.float32),
    "int8": (jnp.int8, jnp.int32),
}
ORIENTATIONS = {  # name: (weight shape from (K, N), the product of activation x [M, K] and weight w)
    "x @ W": (lambda K, N: (K, N), lambda x, w, acc: jnp.dot(x, w, preferred_element_type=acc)),
    "W @ x.T": (lambda K, N: (N, K),
                lambda x, w, acc: jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=acc)),
}


def operand(shape: tuple[int, int], dtype, rng: np.random.Generator) -> jax.Array:
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-127, 128, shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls timed in a round, each on its own")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    rng = np.random.default_rng(0)
    cases = {}
    for shape_name, (M, K, N) in SHAPES.items():
        for dtype_name, (dtype, accumulate) in DTYPES.items():
            for form, (weight_shape, product) in ORIENTATIONS.items():
                jitted_product = jax.jit(lambda x, w, product=product, acc=accumulate: product(x, w, acc))
                x, w = operand((M, K), dtype, rng), operand(weight_shape(K, N), dtype, rng)
                jitted_product(x, w).block_until_ready()  # compile and first run
                cases[shape_name, dtype_name, form] = (jitted_product, x, w)
    times: dict[tuple[str, str, str], list[float]] = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, (jitted_product, x, w) in cases.items():
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jitted_product(x, w).block_until_ready()
                times[key].append(time.perf_counter() - t0)

    table = Table(title=f"GEMM by operand dtype, {jax.devices()[0].device_kind}, median of {args.rounds} rounds x {args.calls} calls")
    for column in ("shape (M rows, K -> N)", "dtype", "form", "ms", "G op/s", "vs best bfloat16"):
        table.add_column(column, justify="right")
    results = []
    for shape_name, (M, K, N) in SHAPES.items():
        best_bf16_ms = min(statistics.median(times[shape_name, "bfloat16", form]) for form in ORIENTATIONS) * 1e3
        for dtype_name in DTYPES:
            for form in ORIENTATIONS:
                ms = statistics.median(times[shape_name, dtype_name, form]) * 1e3
                rate = 2 * M * K * N / (ms * 1e-3) / 1e9
                results.append({"shape": shape_name, "m": M, "k": K, "n": N, "dtype": dtype_name, "form": form,
                                "ms": round(ms, 3), "gops": round(rate, 1),
                                "speed_vs_best_bf16": round(best_bf16_ms / ms, 3)})
                table.add_row(shape_name, dtype_name, form, f"{ms:.2f}", f"{rate:.0f}", f"{best_bf16_ms / ms:.2f}x")
    Console().print(table)
    print(json.dumps({"benchmark": "gemm_dtypes", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                      "rounds": args.rounds, "calls": args.calls, "results": results}))


if __name__ == "__main__":
    main()
