"""Quantisation options on this machine: decode speed and quality against the unquantised model.

- `e2b`: the E2B-shaped benchmark model of benchmarks/decode.py (Gemma 4 E2B with 6 layers: hidden
  1536, FFN 6144 / 12288, vocab 262144, PLE 256, KV sharing), random bf16 weights N(0, 1/fan_in).
  Decode tok/s at batch 1 through the engine's own `decode_step` (fast-path layout, after warm-up,
  median of `--repeats` runs of `--steps` chained steps at context `--context`), and the relative
  logit error and greedy agreement over teacher-forced decode steps.
- `builtin`: the real default model (Gemma 3 270M from the built-in GGUF, converted once), on a fixed
  English text: relative logit error, greedy agreement and perplexity, token by token through the
  decode path (so the KV cache is read at every step).
- `forms`: each spelling of x @ W.T for int8 / int4 weights on E2B's gate and down shapes at 1 and
  8 rows (gemmax's CPU forms, dequantise-in-register row reductions, dequantise-then-dot, bf16), in
  Gparam/s: the measurement behind gemmax.quant's choice of form on CPU (gemmax.quant.cpu).
- the weight bytes of the full E2B config per option, from shapes (`jax.eval_shape`).

Quality metrics, per position: logits centred (softmax ignores offsets); relative error =
||Δ|| / ||reference|| over all positions; agreement = share of positions whose top-1 token equals the
unquantised model's. The options are quantised with the loader's own functions (gemmax.quant).

    python benchmarks/quant.py                                # forms, both models, all options
    python benchmarks/quant.py --models builtin --options none,int8,ple4+int8_lm_head

Prints markdown tables and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmax import quant as Q
from gemmax.engine.fastpath import column_blocks, prepare_params, split_columns
from gemmax.engine.policy import device_policy
from gemmax.engine.steps import decode_step, init_device_state
from gemmax.model.config import E2B_SIX_LAYER_CONFIG, E2B_TEXT_CONFIG, ModelConfig
from gemmax.model.forward import Precision, forward
from gemmax.model.kv_cache import init_cache
from gemmax.model.linear import GEMV_MAX_IN, linear
from gemmax.model.params import count_bytes, random_params

OPTIONS = {
    "none": Q.QuantOptions(),
    "int8": Q.QuantOptions(quant="int8"),
    "w4a16": Q.QuantOptions(quant="w4a16"),
    "ple8": Q.QuantOptions(ple_bits=8),
    "ple4": Q.QuantOptions(ple_bits=4),
    "int8_lm_head": Q.QuantOptions(int8_lm_head=True),
    "kv_int8": Q.QuantOptions(kv_cache="int8"),
    "ple4+int8_lm_head": Q.QuantOptions(ple_bits=4, int8_lm_head=True),
    "int8+int8_lm_head": Q.QuantOptions(quant="int8", int8_lm_head=True),  # --quant auto on a quantised GGUF
    "int8+ple4+int8_lm_head+kv_int8": Q.QuantOptions(quant="int8", ple_bits=4, int8_lm_head=True, kv_cache="int8"),
    "w4a16+ple4+int8_lm_head": Q.QuantOptions(quant="w4a16", ple_bits=4, int8_lm_head=True),
}
TEXT = (
    "The lighthouse stood at the end of a long breakwater, its white paint worn grey by decades of salt "
    "and wind. Every evening the keeper climbed the spiral stairs, trimmed the wick and wound the clockwork "
    "that turned the great lens. Ships passing in the night saw the beam sweep across the water once every "
    "ten seconds, and they knew exactly where they were. When the light was finally automated, the keeper "
    "moved to a small house in the village, but he still walked out along the breakwater at dusk."
)
_forward = jax.jit(forward, static_argnames=("config", "precision", "logits"))




def teacher_forced(params, config: ModelConfig, tokens: list[int], kv_dtype) -> np.ndarray:
    """Logits [T-1, V] at each position, fed one token at a time through the decode path."""
    precision = Precision(jnp.float32, kv_dtype)
    cache = init_cache(config, 1, len(tokens), kv_dtype)
    out = []
    for t in range(len(tokens) - 1):
        logits, cache = _forward(params, cache, jnp.asarray([[tokens[t]]], jnp.int32), jnp.asarray([t], jnp.int32),
                                 jnp.ones(1, jnp.int32), config=config, precision=precision)
        out.append(np.asarray(logits[0]))
    return np.stack(out)


def quality(logits: np.ndarray, reference: np.ndarray, targets: list[int] | None = None) -> dict[str, float]:
    def centre(x):
        return x - x.mean(-1, keepdims=True)
    out = {
        "rel_logit_error": float(np.linalg.norm(centre(logits) - centre(reference)) / np.linalg.norm(centre(reference))),
        "max_abs_logit_error": float(np.abs(logits - reference).max()),
        "greedy_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
    }
    if targets is not None:
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        out["perplexity"] = float(np.exp(-logp[np.arange(len(targets)), targets].mean()))
    return out


def decode_tok_s(params, config: ModelConfig, kv_dtype, steps: int, repeats: int, context: int) -> float:
    """Batch-1 decode steps/s through the engine's decode_step at a fixed context."""
    precision = Precision(jnp.float32, kv_dtype)
    device = dataclasses.replace(init_device_state(config, 1, context + 8, precision), tokens=jnp.full(1, 5, jnp.int32),
                                 positions=jnp.full(1, context, jnp.int32), remaining=jnp.full(1, 1 << 30, jnp.int32))
    state, want = {"device": device}, jnp.zeros(1, jnp.bool_)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            device, _ = decode_step(params, state["device"], want, config=config, precision=precision)
            state["device"] = dataclasses.replace(device, positions=device.positions - 1)  # same context
        jax.block_until_ready(state["device"].tokens)
        return (time.perf_counter() - t0) / n

    run(2)
    return 1.0 / statistics.median(run(steps) for _ in range(repeats))


# ------------------------------------------------------------------------------------------- forms


def _row_reduce(x, w):
    """Dequantise in registers, multiply and reduce each row: (W * x).sum(-1), per row of x."""
    return jnp.stack([(w.dequantize(jnp.float32) * x[r]).sum(-1) for r in range(x.shape[0])])


def _dequantize_then_dot(x, w):
    """Materialise W in bf16, then the GEMM / matrix-vector product."""
    return (x.astype(jnp.bfloat16) @ w.dequantize(jnp.bfloat16).T).astype(jnp.float32)


def bench_forms(args, policy) -> list[dict]:
    """Gparam/s of each spelling of x [rows, in] @ W.T on E2B's gate (6144 x 1536) and down (1536 x 6144)
    shapes: 8 matrices per call (independent products), median of interleaved rounds."""
    def spellings(w):
        q8, q4 = Q.quantize_int8(w, "cpu"), Q.quantize_int4(w, "cpu")
        q8_copy = Q.quantize_int8(w, "cpu", gemm_copy=True)  # a default CPU load (`--int8-gemm-copy`)

        def fast(form):  # the column blocks `prepare_params` stores on CPU
            return form if w.shape[1] <= GEMV_MAX_IN else split_columns(form, column_blocks(w.shape[1]))
        return {
            "bf16 (gemmax.model.linear)": (linear, fast(w)),
            "int8 gemmax 'cpu' form": (linear, fast(q8)),
            "int8 gemmax 'cpu' form with its bf16 GEMM copy": (linear, fast(q8_copy)),
            "int8 row reduction": (_row_reduce, q8),
            "int8 dequantise-then-dot": (_dequantize_then_dot, q8),
            "int4 gemmax 'cpu' form": (linear, fast(q4)),
            "int4 row reduction": (_row_reduce, q4),
            "int4 dequantise-then-dot": (_dequantize_then_dot, q4),
        }

    rows_out = []
    for shape in ((6144, 1536), (1536, 6144)):
        weights = [jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) * shape[1] ** -0.5 for i in range(8)]
        per = [spellings(w) for w in weights]
        for rows in (1, 8):
            x = jax.random.normal(jax.random.key(99), (rows, shape[1]), jnp.float32)
            timed = {}
            for name in per[0]:
                fn = per[0][name][0]
                forms = [p[name][1] for p in per]
                call = jax.jit(lambda x, forms, fn=fn: [fn(x, f) for f in forms])
                jax.block_until_ready(call(x, forms))
                timed[name] = (call, forms, [])
            for _ in range(args.repeats):
                for call, forms, times in timed.values():
                    t0 = time.perf_counter()
                    jax.block_until_ready(call(x, forms))
                    times.append(time.perf_counter() - t0)
            for name, (_, forms, times) in timed.items():
                row = {"shape": f"{shape[0]}x{shape[1]}", "rows": rows, "form": name,
                       "gparam_s": 8 * shape[0] * shape[1] / statistics.median(times) / 1e9,
                       "bytes": count_bytes(forms)}
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    return rows_out


def quantized(params, config, options: Q.QuantOptions, policy):
    if options.changes_weights:
        plan = Q.resolve(options, policy.platform)
        params = Q.quantize_params(params, config, plan.options, plan.kernel)
    return params, count_bytes(params)


def bench_e2b(names: list[str], args, policy) -> list[dict]:
    config = ModelConfig.from_hf_config(E2B_SIX_LAYER_CONFIG)
    base = random_params(config, weight_dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, config.vocab_size, args.quality_tokens)]
    rows, reference = [], None
    for name in names:
        options = OPTIONS[name]
        kv = jnp.int8 if options.kv_cache == "int8" else policy.precision().kv_cache
        params, nbytes = quantized(base, config, options, policy)
        fast = prepare_params(params, config, policy)
        logits = teacher_forced(fast, config, tokens, kv)
        if reference is None:
            if name != "none":
                raise SystemExit("the first e2b option must be 'none' (the reference)")
            reference = logits
        row = {"model": "e2b-6-layers", "option": name, "weight_bytes": nbytes,
               "decode_tok_s": decode_tok_s(fast, config, kv, args.steps, args.repeats, args.context),
               **quality(logits, reference)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del params, fast, logits
        gc.collect()
    return rows


def bench_builtin(names: list[str], policy) -> list[dict]:
    from gemmax.weights.builtin import default_model_path
    from gemmax.weights.load import load_checkpoint
    from gemmax.weights.tokenizer import load_tokenizer

    directory = default_model_path()
    checkpoint = load_checkpoint(directory, weight_dtype=policy.weight_dtype)
    config = checkpoint.config
    tokens = load_tokenizer(directory).encode(TEXT)
    rows, reference = [], None
    for name in names:
        options = OPTIONS[name]
        if options.ple_bits != 16 and not config.hidden_size_per_layer_input:
            continue  # Gemma 3 has no per-layer embeddings
        kv = jnp.int8 if options.kv_cache == "int8" else policy.precision().kv_cache
        params, nbytes = quantized(checkpoint.params, config, options, policy)
        logits = teacher_forced(prepare_params(params, config, policy), config, tokens, kv)
        if reference is None:
            reference = logits
        row = {"model": "gemma-3-270m (built-in)", "option": name, "weight_bytes": nbytes, "tokens": len(tokens),
               **quality(logits, reference, tokens[1:])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(format(r[key], fmt) if key in r else "n/a" for key, _, fmt in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="forms,e2b,builtin")
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--quality-tokens", type=int, default=33, help="teacher-forced tokens on the e2b model")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    names = args.options.split(",")
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        raise SystemExit(f"unknown options {unknown}; choose from {list(OPTIONS)}")
    policy = device_policy()
    print(policy.log_line(), flush=True)

    full_e2b = ModelConfig.from_hf_config({**E2B_TEXT_CONFIG, "use_bidirectional_attention": None})
    sizes = Q.weight_bytes_table(full_e2b)
    print("\nE2B weight bytes per option (eval_shape, bf16 otherwise, norms float32)\n")
    print(markdown([{"option": k, "bytes": v, "gib": v / 2**30, "share": v / sizes["none"]} for k, v in sizes.items()],
                   [("option", "option", "s"), ("bytes", "bytes", ",d"), ("gib", "GiB", ".3f"), ("share", "of none", ".1%")]))

    rows = []
    if "forms" in args.models:
        rows += (forms := bench_forms(args, policy))
        print("\nx [rows, in] @ W.T spellings (Gparam/s: weights multiplied per second)\n")
        print(markdown(forms, [("shape", "W", "s"), ("rows", "rows", "d"), ("form", "form", "s"),
                               ("gparam_s", "Gparam/s", ".2f")]))
    if "e2b" in args.models:
        rows += (e2b := bench_e2b(names, args, policy))
        print("\nE2B-shaped model (6 layers, random bf16 weights), batch 1, context", args.context, "\n")
        print(markdown(e2b, [("option", "option", "s"), ("weight_bytes", "weight bytes", ",d"),
                             ("decode_tok_s", "decode tok/s", ".2f"), ("rel_logit_error", "rel. logit error", ".4f"),
                             ("greedy_agreement", "greedy agreement", ".3f")]))
    if "builtin" in args.models:
        rows += (real := bench_builtin(names, policy))
        print(f"\nGemma 3 270M (built-in), {real[0]['tokens'] if real else 0} tokens of a fixed text\n")
        print(markdown(real, [("option", "option", "s"), ("weight_bytes", "weight bytes", ",d"),
                              ("rel_logit_error", "rel. logit error", ".4f"),
                              ("greedy_agreement", "greedy agreement", ".3f"), ("perplexity", "perplexity", ".3f")]))
    result = {"policy": policy.log_line(), "e2b_weight_bytes": sizes, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
