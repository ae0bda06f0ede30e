"""Would a layer scan keep decode and prefill fast on this machine? The weight reads alone, unrolled
against `lax.scan`, side by side in one process.

Start-up is compile and executable loading, and every program holds the model's layers unrolled
(README, "Start-up"): a scan over layers would compile and load one layer's code instead of all of
them. What it would cost at run time depends on whether XLA keeps its fast weight reads when the
weight is a slice of a stacked array chosen by the loop counter. This measures exactly that, with
the model's own weight reads (`gemmax.model.linear.linear`, and the int8 form `serve` uses on CPU,
`quantize_int8(kernel="cpu", gemm_copy=True)`), on a stack of MLP blocks shaped like the built-in
model's (18 layers, hidden 640, intermediate 2048: gate, up, down: 70.8 M weights, 141.6 MB in bf16):

    h <- h + down(gelu(gate(h)) * up(h))        for each layer

- unrolled: a Python loop over per-layer weights, as `gemmax.model.forward` runs the layers;
- scan: `lax.scan` over the same weights stacked [layers, ...] (each form's leaves stacked);
- scan-bits: the same scan with every bfloat16 leaf (the bf16 weights, the int8 form's bf16 GEMM
  copy and scales) stacked as its uint16 bits and bitcast back inside the loop body. XLA:CPU (jax
  0.10.2) widens the bf16 arrays a loop carries to float32: once per call, before the loop, the
  whole stack is converted (twice its bytes written), and each iteration slices the float32 stack
  and rounds the slice back to bf16 (visible in the optimised HLO). A uint16 slice is taken as it
  is. (The bf16 KV cache is held as bits for the same kind of reason: gemmax.model.kv_cache.)

For each stored form (float32, bfloat16, int8) and row count (1: batch-1 decode; 8: batched decode;
64: a prefill chunk), it reports the compile time, the first call (XLA:CPU sets up each GEMM's
YNNPACK pipeline on a program's first run: a warm start's first runs, README "Start-up"), the median
time per call after it (and the spread over repeats), the weight bytes read per second, and the
optimised HLO's size (what the executable store loads grows with it).

    python benchmarks/layer_scan.py [--rows 1,8,64] [--forms float32,bfloat16,int8] [--repeats 5]
                                    [--calls 20] [--layers 18] [--hidden 640] [--intermediate 2048]
                                    [--builtin]

`--builtin` also times a prototype on the built-in model as `serve` loads it (int8 layers and LM
head): its decode step with the layers as a scan over the period of its layer pattern (3 x 6 layers:
5 sliding, 1 full), bf16 leaves as bits, against `forward` as it is, at batch 1 and 8, with the
logits compared. The prototype reuses the model's private layer function and passes each layer's
cache through the scan as a slice in and a new slice out, so it copies every cache array twice per
step, where an implementation would update the stacked cache in place: its step time is an upper
bound.

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

from gemmax.model import forward as model_forward
from gemmax.model.linear import linear
from gemmax.model.ops import gelu_tanh
from gemmax.quant.int8 import quantize_int8


def layer_weights(layers: int, hidden: int, intermediate: int, form: str, seed: int = 0) -> list[dict]:
    """Per-layer {gate, up, down} in the stored form `form` (float32, bfloat16 or int8)."""
    rng = np.random.default_rng(seed)
    shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
    out = []
    for _ in range(layers):
        layer = {}
        for name, shape in shapes.items():
            w = jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
            if form == "int8":
                layer[name] = quantize_int8(w.astype(jnp.bfloat16), kernel="cpu", gemm_copy=True)
            else:
                layer[name] = w.astype(form)
        out.append(layer)
    return jax.block_until_ready(out)


def block(h: jax.Array, layer: dict) -> jax.Array:
    """One MLP block of the model's spelling (`forward._decoder_layer`'s MLP, norms left out)."""
    return h + linear(gelu_tanh(linear(h, layer["gate"])) * linear(h, layer["up"]), layer["down"])


def unrolled(layers: list[dict], h: jax.Array) -> jax.Array:
    for layer in layers:
        h = block(h, layer)
    return h


def scanned(stacked: dict, h: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, layer: (block(h, layer), None), h, stacked)[0]


def stack(trees: list) -> dict:
    """Trees of one structure as one tree, each leaf stacked along a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def as_bits(tree):
    """Every bfloat16 leaf as its uint16 bits (same bytes, no copy of the values' meaning)."""
    return jax.tree.map(lambda w: jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == jnp.bfloat16 else w, tree)


def from_bits(tree):
    return jax.tree.map(lambda w: jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == jnp.uint16 else w, tree)


def scanned_bits(stacked_bits: dict, h: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, layer: (block(h, from_bits(layer)), None), h, stacked_bits)[0]


def weight_bytes(layers: list[dict], rows: int) -> int:
    """Bytes one call reads: the arrays a product of `rows` rows multiplies (int8: the values and
    scales up to its GEMM threshold, the bf16 copy from it)."""
    total = 0
    for layer in layers:
        for w in layer.values():
            total += w.bytes_read(rows) if hasattr(w, "bytes_read") else w.size * w.dtype.itemsize
    return total


def timed(call, args, repeats: int, calls: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            y = call(*args)
        jax.block_until_ready(y)
        out.append((time.perf_counter() - start) / calls)
    return out


def print_row(row: dict) -> None:
    rate = "" if row["weight_gb_s"] is None else f"{row['weight_gb_s']:.1f}"
    extra = f"  logits max diff {row['max_abs_logit_diff']:.1e}" if "max_abs_logit_diff" in row else ""
    print(f"{row['form']:<12} {row['rows']:>4} {row['mode']:<9} {row['compile_s']:>9.2f} {row['first_ms']:>8.1f} "
          f"{row['ms']:>8.2f} ({row['ms_min']:.2f}-{row['ms_max']:.2f}) {rate:>6} {row['hlo_kb']:>7}{extra}")


def builtin_prototype(repeats: int, calls: int, max_len: int = 512, context: int = 100) -> list[dict]:
    """The built-in model's decode step, unrolled (`forward`) against a scan over its layer period."""
    import dataclasses

    from gemmax.engine.loading import load_model
    from gemmax.engine.steps import init_device_state
    from gemmax.quant.options import QuantOptions

    loaded = load_model(None, "auto", QuantOptions(quant="auto"))
    config, params, precision = loaded.checkpoint.config, loaded.checkpoint.params, loaded.policy.precision()
    specs, n_layers = config.layers, config.num_layers
    same = lambda a, b: dataclasses.replace(a, kv_donor=0) == dataclasses.replace(b, kv_donor=0)  # noqa: E731
    period = next(p for p in range(1, n_layers + 1)
                  if n_layers % p == 0 and all(same(specs[i], specs[i % p]) for i in range(n_layers)))
    repeats_of = n_layers // period

    def by_period(layers):  # [period] trees, leaves stacked over the repeats of the pattern
        return tuple(stack([layers[j + r * period] for r in range(repeats_of)]) for j in range(period))

    stacked_params = jax.block_until_ready(as_bits(by_period(params["layers"])))

    def scan_step(params, stacked_params, stacked_cache, tokens, start, num_new, kv_len):
        positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
        batch = model_forward._Batch(start=start, new_pos=positions, new_valid=positions < (start + num_new)[:, None],
                                     q_pos=positions, kv_len=kv_len)
        h = model_forward.embed(params, tokens, config, precision.activation)

        def body(h, per_period):
            layers, caches = per_period
            written = []
            for j in range(period):  # layer index j: right while no layer reads another's cache (no KV sharing)
                h, entry = model_forward._decoder_layer(from_bits(layers[j]), h, None, specs[j], config, batch,
                                                        caches[j], {}, j)
                written.append(entry)
            return h, tuple(written)

        h, stacked_cache = jax.lax.scan(body, h, (stacked_params, stacked_cache))
        normed = model_forward.rms_norm(h[:, 0], params["final_norm"], config.rms_norm_eps)
        return model_forward.head(params, normed, config), stacked_cache

    def unrolled_step(params, cache, tokens, start, num_new, kv_len):
        return model_forward.forward(params, cache, tokens, start, num_new, config=config, precision=precision,
                                     kv_len=kv_len)

    rows_out = []
    for batch_size in (1, 8):
        cache = init_device_state(config, batch_size, max_len, precision).cache
        inputs = (jnp.full((batch_size, 1), 7, jnp.int32), jnp.full(batch_size, context, jnp.int32),
                  jnp.ones(batch_size, jnp.int32))
        logits = {}
        for mode, fn, weights in (("unrolled", unrolled_step, (params, cache)),
                                  ("scan-bits", scan_step, (params, stacked_params, by_period(cache.layers)))):
            start = time.perf_counter()
            call = jax.jit(fn, static_argnames=("kv_len",)).lower(*weights, *inputs, kv_len=256).compile()
            compiled_at = time.perf_counter()
            logits[mode] = jax.block_until_ready(call(*weights, *inputs))[0]
            first = time.perf_counter() - compiled_at
            times = timed(call, (*weights, *inputs), repeats, calls)
            rows_out.append({"form": "builtin int8", "rows": batch_size, "mode": mode,
                             "compile_s": round(compiled_at - start, 3), "first_ms": round(first * 1e3, 2),
                             "ms": round(statistics.median(times) * 1e3, 3), "ms_min": round(min(times) * 1e3, 3),
                             "ms_max": round(max(times) * 1e3, 3), "weight_gb_s": None,
                             "hlo_kb": len(call.as_text()) // 1000})
        diff = float(jnp.max(jnp.abs(logits["unrolled"] - logits["scan-bits"])))
        for row in rows_out[-2:]:
            row["max_abs_logit_diff"] = diff
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--forms", default="float32,bfloat16,int8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--builtin", action="store_true", help="also the built-in model's decode step (prototype)")
    args = parser.parse_args()

    results = []
    print(f"{'form':<12} {'rows':>4} {'mode':<9} {'compile s':>9} {'first ms':>8} {'ms per call':>22} {'GB/s':>6} "
          f"{'HLO kB':>7}")
    for form in args.forms.split(","):
        layers = layer_weights(args.layers, args.hidden, args.intermediate, form)
        stacked = stack(layers)
        stacked_bits = as_bits(stacked)
        for rows in (int(r) for r in args.rows.split(",")):
            h = jnp.ones((rows, args.hidden), jnp.float32)
            compiled = {}
            for mode, fn, weights in (("unrolled", unrolled, layers), ("scan", scanned, stacked),
                                      ("scan-bits", scanned_bits, stacked_bits)):
                start = time.perf_counter()
                call = jax.jit(fn).lower(weights, h).compile()
                compiled_at = time.perf_counter()
                call(weights, h).block_until_ready()
                compiled[mode] = (call, weights, compiled_at - start, time.perf_counter() - compiled_at)
            times = {mode: [] for mode in compiled}
            for _ in range(2):  # alternated: this machine drifts between runs
                for mode, (call, weights, *_) in compiled.items():
                    times[mode] += timed(call, (weights, h), args.repeats, args.calls)
            moved = weight_bytes(layers, rows)
            for mode, (call, _, compile_s, first_s) in compiled.items():
                med = statistics.median(times[mode])
                row = {"form": form, "rows": rows, "mode": mode, "compile_s": round(compile_s, 3),
                       "first_ms": round(first_s * 1e3, 2),
                       "ms": round(med * 1e3, 3), "ms_min": round(min(times[mode]) * 1e3, 3),
                       "ms_max": round(max(times[mode]) * 1e3, 3), "weight_gb_s": round(moved / med / 1e9, 2),
                       "hlo_kb": len(call.as_text()) // 1000}
                results.append(row)
                print_row(row)
    if args.builtin:
        for row in builtin_prototype(args.repeats, args.calls):
            results.append(row)
            print_row(row)

    def over_unrolled(mode: str) -> dict[str, float]:
        return {f"{r['form']}/{r['rows']}": round(s["ms"] / r["ms"], 2)
                for r in results if r["mode"] == "unrolled"
                for s in results if s["mode"] == mode and (s["form"], s["rows"]) == (r["form"], r["rows"])}

    print(json.dumps({"benchmark": "layer_scan", "jax": jax.__version__, "backend": jax.default_backend(),
                      "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                      "scan_over_unrolled_time": over_unrolled("scan"),
                      "scan_bits_over_unrolled_time": over_unrolled("scan-bits"), "results": results}))


if __name__ == "__main__":
    main()
