"""CPU decode forms: GB/s of matrix-product spellings, and decode tok/s of the fast path (docs/cpu_decode.md).

    python benchmarks/cpu_decode_forms.py forms  [--rounds 7]
    python benchmarks/cpu_decode_forms.py decode [--rounds 7] [--batch 1,8] [--context 128] [--max-len 1024]
                                                 [--kv float32,bfloat16] [--naive]

`forms`: 8 weight matrices of 6144x1536 (A, out x in) or 1536x6144 (B) in one jit, each applied to the
same input; GB/s = weight bytes / time. `decode`: one decode step of the E2B-shaped 6-layer model
(random bf16 weights) with the weights as `prepare_params` stores them, against the bandwidth
roofline (bytes a step must read / all-core read bandwidth measured in the same rounds).

The machine is shared, so every timed sample also records how much CPU other processes took while it
ran (from /proc/stat); medians are over the "quiet" samples (others < 15% of the cores) when there
are at least 3, else over all (the table says which). Rounds interleave the variants.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gemmax.engine.fastpath import check_decode_hlo, prepare_params  # noqa: E402
from gemmax.engine.memory import bytes_per_decode_step, measure_read_bandwidth  # noqa: E402
from gemmax.engine.policy import device_policy  # noqa: E402
from gemmax.model.config import E2B_SIX_LAYER_CONFIG, ModelConfig  # noqa: E402
from gemmax.model.forward import Precision, forward  # noqa: E402
from gemmax.model.kv_cache import init_cache  # noqa: E402
from gemmax.model.params import random_params  # noqa: E402

QUIET = 0.15  # other processes' share of all cores below which a sample counts as quiet
BF16, F32 = jnp.bfloat16, jnp.float32


def _busy_ticks() -> tuple[int, int]:
    """(all processes' busy ticks, this process's ticks)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return busy, int(mine[11]) + int(mine[12])  # utime + stime


def timed(fn) -> tuple[float, float, Any]:
    """(seconds fn() took, share of all cores other processes used meanwhile, fn's result)."""
    busy0, mine0 = _busy_ticks()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    busy1, mine1 = _busy_ticks()
    ticks = seconds * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    return seconds, max(0.0, ((busy1 - busy0) - (mine1 - mine0)) / ticks), result


def summarize(samples: list[tuple[float, float]]) -> tuple[float, float, int]:
    """(median seconds over quiet samples, or all when fewer than 3 are quiet; best; quiet count)."""
    quiet = [s for s, other in samples if other < QUIET]
    pool = quiet if len(quiet) >= 3 else [s for s, _ in samples]
    return statistics.median(pool), min(s for s, _ in samples), len(quiet)


# ------------------------------------------------------------------------------------------- forms

DN_T = (((1,), (1,)), ((), ()))  # x [B, K] . W [N, K]
DN_N = (((1,), (0,)), ((), ()))  # x [B, K] . W [K, N]


def _split(w: jax.Array, width: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.array(w[:, i : i + width]) for i in range(0, w.shape[1], width))


def _split_product(x, blocks):
    parts, start = [], 0
    for b in blocks:
        parts.append((x[:, start : start + b.shape[1]].astype(BF16) @ b.T).astype(F32))
        start += b.shape[1]
    parts = lax.optimization_barrier(parts)
    return sum(parts[1:], parts[0])


FORMS = {  # name: (layout, dtype, function of x [B, K] and the stored weight)
    "(x.astype(bf16) @ W.T) [out,in]": ("out_in", BF16, lambda x, w: (x.astype(BF16) @ w.T).astype(F32)),
    "same, K split in 2 + barrier": ("split", BF16, _split_product),
    "x_f32 @ W.T (bf16 W)": ("out_in", BF16, lambda x, w: x @ w.T),
    "dot_general pref f32 [out,in]": ("out_in", BF16,
                                      lambda x, w: lax.dot_general(x.astype(BF16), w, DN_T, preferred_element_type=F32)),
    "dot_general pref f32 [in,out]": ("in_out", BF16,
                                      lambda x, w: lax.dot_general(x.astype(BF16), w, DN_N, preferred_element_type=F32)),
    "x.astype(bf16) @ W [in,out]": ("in_out", BF16, lambda x, w: (x.astype(BF16) @ w).astype(F32)),
    "f32 weights x @ W.T [out,in]": ("out_in", F32, lambda x, w: x @ w.T),
    "f32 weights x @ W [in,out]": ("in_out", F32, lambda x, w: x @ w),
    "f16 weights (x.astype(f16) @ W.T)": ("out_in", jnp.float16, lambda x, w: (x.astype(jnp.float16) @ w.T).astype(F32)),
    "(W.astype(f32) * x).sum(-1)": ("out_in", BF16, lambda x, w: (w.astype(F32)[None] * x[:, None, :]).sum(-1)),
}


def run_forms(rounds: int, batches: list[int]) -> dict:
    rng = np.random.default_rng(0)
    results = {}
    for shape_name, (out, k) in (("A 6144x1536", (6144, 1536)), ("B 1536x6144", (1536, 6144))):
        base = [rng.standard_normal((out, k), np.float32) * k**-0.5 for _ in range(8)]
        cases = {}
        for batch in batches:
            x = jnp.asarray(rng.standard_normal((batch, k)), F32)
            for name, (layout, dtype, fn) in FORMS.items():
                if layout == "split" and k <= 4095:
                    continue
                if layout == "split":
                    ws = [_split(jnp.asarray(w, dtype), k // 2) for w in base]
                elif layout == "in_out":
                    ws = [jnp.asarray(w.T.copy(), dtype) for w in base]
                else:
                    ws = [jnp.asarray(w, dtype) for w in base]
                f = jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws]).lower(x, ws).compile()
                nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(ws))
                cases[(shape_name, batch, name)] = (f, x, ws, nbytes, [])
        for _ in range(rounds):
            for f, x, ws, _, samples in cases.values():
                jax.block_until_ready(f(x, ws))
                samples.append(timed(lambda f=f, x=x, ws=ws: jax.block_until_ready(f(x, ws)))[:2])
        for (shape, batch, name), (_, _, ws, nbytes, samples) in cases.items():
            med, best, quiet = summarize(samples)
            params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(ws))
            results[f"{shape} B={batch} {name}"] = {
                "gb_s": nbytes / med / 1e9, "best_gb_s": nbytes / best / 1e9, "gparam_s": params / med / 1e9,
                "quiet_samples": quiet,
            }
    print(f"{'form':64s} {'GB/s':>6s} {'best':>6s} {'Gparam/s':>8s} quiet")
    for name, r in results.items():
        print(f"{name:64s} {r['gb_s']:6.1f} {r['best_gb_s']:6.1f} {r['gparam_s']:8.2f} {r['quiet_samples']}")
    return results


# ------------------------------------------------------------------------------------------- decode




def naive_linear(x, w):
    """The obvious spelling on the model's 3-D activations: what gemmax did before the fast path."""
    return (x.astype(w.dtype) @ w.T).astype(x.dtype)


def run_decode(rounds: int, batches: list[int], context: int, max_len: int, kv_dtypes: list[str], naive: bool,
               steps: int) -> dict:
    import gemmax.model.forward as model

    config = ModelConfig.from_hf_config(E2B_SIX_LAYER_CONFIG)
    plain = random_params(config, weight_dtype=jnp.bfloat16)
    prepared = prepare_params(plain, config, device_policy())
    variants = [("fast", prepared, None)] + ([("naive", plain, naive_linear)] if naive else [])
    cases = {}
    for name, params, linear_override in variants:
        for kv in kv_dtypes:
            for batch in batches:
                precision = Precision(F32, jnp.dtype(kv))

                def step(params, cache, tokens, start, precision=precision):
                    logits, cache = forward(params, cache, tokens, start, jnp.ones_like(start), config=config,
                                            precision=precision)
                    return jnp.argmax(logits, -1).astype(jnp.int32)[:, None], cache

                original = model.linear
                model.linear = linear_override or original
                try:
                    cache = init_cache(config, batch, max_len, jnp.dtype(kv))
                    tokens = jnp.zeros((batch, 1), jnp.int32)
                    start = jnp.full((batch,), context, jnp.int32)
                    compiled = jax.jit(step, donate_argnums=(1,)).lower(params, cache, tokens, start).compile()
                finally:
                    model.linear = original
                problems = check_decode_hlo(compiled.as_text(), batch)
                cases[(name, kv, batch)] = {"fn": compiled, "params": params, "cache": cache, "tokens": tokens,
                                            "start": start, "samples": [], "hlo_problems": len(problems)}
    bandwidth = []  # (GB/s, others' share of the cores meanwhile)
    for _ in range(rounds):
        _, other, gbs = timed(lambda: measure_read_bandwidth(256, 3))
        bandwidth.append((gbs, other))
        for case in cases.values():
            def run(case=case):
                for _ in range(steps):
                    case["tokens"], case["cache"] = case["fn"](case["params"], case["cache"], case["tokens"], case["start"])
                case["tokens"].block_until_ready()

            run()
            seconds, other, _ = timed(run)
            case["samples"].append((seconds / steps, other))
    quiet_bw = [b for b, other in bandwidth if other < QUIET]
    gbs = statistics.median(quiet_bw if len(quiet_bw) >= 3 else [b for b, _ in bandwidth])
    results = {"read_bandwidth_gb_s": gbs, "bandwidth_samples": bandwidth}
    print(f"read bandwidth {gbs:.1f} GB/s (samples, others' share: {[(round(b, 1), round(o, 2)) for b, o in bandwidth]})")
    print(f"{'variant':8s} {'kv':9s} {'B':>2s} {'ms/step':>8s} {'tok/s':>7s} {'best':>6s} {'GB/s':>5s} "
          f"{'roofline':>8s} {'share':>5s} quiet hlo_problems")
    for (name, kv, batch), case in cases.items():
        med, best, quiet = summarize(case["samples"])
        nbytes = bytes_per_decode_step(config, prepared, batch, context, jnp.dtype(kv))
        roofline = gbs * 1e9 / nbytes * batch
        tps = batch / med
        results[f"{name}/{kv}/B{batch}"] = {"tok_s": tps, "best_tok_s": batch / best, "ms_per_step": med * 1e3,
                                             "gb_s": nbytes / med / 1e9, "roofline_tok_s": roofline,
                                             "share": tps / roofline, "bytes_per_step": nbytes,
                                             "quiet_samples": quiet, "hlo_problems": case["hlo_problems"]}
        print(f"{name:8s} {kv:9s} {batch:2d} {med * 1e3:8.1f} {tps:7.1f} {batch / best:6.1f} {nbytes / med / 1e9:5.1f} "
              f"{roofline:8.1f} {tps / roofline:5.0%} {quiet:5d} {case['hlo_problems']}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["forms", "decode"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--kv", default="float32")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per timed sample")
    parser.add_argument("--naive", action="store_true", help="also time the naive spelling (slow: ~1 s/step)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.mode == "forms":
        results = run_forms(args.rounds, batches)
    else:
        results = run_decode(args.rounds, batches, args.context, args.max_len, args.kv.split(","), args.naive,
                             args.steps)
    meta = {"jax": jax.__version__, "cpus": os.cpu_count(), "mode": args.mode, **vars(args)}
    print(json.dumps({"meta": meta, "results": results}))


if __name__ == "__main__":
    main()
