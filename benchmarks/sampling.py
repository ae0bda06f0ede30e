"""The sampler alone, before and after the sort-free rewrite, side by side in one process.

Times the id path of one decode step's sampling (the greedy argmax for every row, and under a `cond`
the sampled draw for the rows with a temperature, as `engine.sampling.sample` runs it without
penalties or logprobs) on [B, 262144] f32 logits, at batch 1 and 8, for greedy, temperature 1.0,
temperature 0.7 with top_p 0.9, top_k 40 and min_p 0.05. "before" is the sampler that sorted the whole
vocabulary on every sampled step (`lax.top_k(scaled, V)`), kept here verbatim as the baseline.

The logits look like a language model's: a Gaussian body (std 2) and 32 strong tokens 8-16 above
it, so top_p 0.9 and min_p 0.05 keep a few tokens, as they do on real text. Rows whose kept set does
not fit the 1,024 best tokens take the whole-row thresholds (`--flat` shows it: Gaussian rows alone,
std 0.5 or the one given; at std 0.5 no window is tried, at 1 to 3 some are, on CPU, and at 3 the
1,024-window proves top_p 0.9 at temperature 0.7).

    python benchmarks/sampling.py [--repeats 5] [--calls 10] [--flat [STD]] [--bf16] [--against OTHER/src]

`--bf16` rounds the logits through bfloat16, as an accelerator's bfloat16 head gives them: hundreds
of entries then tie at any threshold. `--against` puts another version's sampler in the "before"
column instead of the sort: the
`_filtered_sample` of OTHER/src/gemmax/engine/sampling.py (a `git worktree` of an earlier commit),
loaded beside this one in the same process.

Prints a table (median ms per call and the spread over repeats) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmax.engine.sampling import SamplingState, _argmax, _filtered_sample

VOCAB = 262144
MODES = {  # temperature, top_k, top_p, min_p
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature 1.0": (1.0, 0, 1.0, 0.0),
    "0.7 + top_p 0.9": (0.7, 0, 0.9, 0.0),
    "top_k 40": (1.0, 40, 1.0, 0.0),
    "min_p 0.05": (1.0, 0, 1.0, 0.05),
}


def sorted_sample(logits: jax.Array, state: SamplingState) -> jax.Array:
    """The sampler before: temperature, a sort of the whole vocabulary, top-k, top-p, min-p, categorical."""
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(state.temperature, 1e-6)[:, None]
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, V)  # [B, V] descending
    rank = jnp.arange(V)[None, :]
    keep = (state.top_k[:, None] <= 0) | (rank < state.top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < state.top_p[:, None]
    keep &= probs >= state.min_p[:, None] * probs[:, :1]
    keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(state.key, state.step)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=1)[:, 0]


def other_sampler(src: str):
    """`_filtered_sample` of the source tree `src` (its engine/sampling.py loaded as its own module)."""
    spec = importlib.util.spec_from_file_location("other_sampling", f"{src}/gemmax/engine/sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._filtered_sample


def choose(draw):
    """The id path of `sample` without penalties: the argmax, and the draw only when a row samples."""
    def ids(logits, state):
        sampling = state.temperature > 0
        greedy = _argmax(logits)
        return jax.lax.cond(jnp.any(sampling), lambda: jnp.where(sampling, draw(logits, state), greedy).astype(jnp.int32),
                            lambda: greedy)
    return jax.jit(ids)


def lm_logits(batch: int, flat: float | None, bf16: bool = False, seed: int = 0) -> jax.Array:
    """[batch, VOCAB] float32 logits: language-model-like, or (`flat`) a Gaussian of that std alone;
    `bf16`: rounded through bfloat16, as a bfloat16 head computes them (a few thousand distinct values
    in a row, so hundreds of entries tie at any threshold)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, VOCAB)).astype(np.float32) * (flat or 2.0)
    if not flat:
        for row in logits:
            row[rng.choice(VOCAB, 32, replace=False)] += np.linspace(16.0, 8.0, 32, dtype=np.float32)
    logits = jnp.asarray(logits)
    return logits.astype(jnp.bfloat16).astype(jnp.float32) if bf16 else logits


def state_for(batch: int, mode: tuple) -> SamplingState:
    temperature, top_k, top_p, min_p = mode
    f = lambda v: jnp.full(batch, v, jnp.float32)  # noqa: E731
    return dataclasses.replace(
        SamplingState.empty(batch, 1), temperature=f(temperature), top_k=jnp.full(batch, top_k, jnp.int32),
        top_p=f(top_p), min_p=f(min_p), key=jnp.tile(jnp.arange(2, dtype=jnp.uint32), (batch, 1)) + jnp.arange(batch, dtype=jnp.uint32)[:, None])


def time_ms(fn, logits, state, repeats: int, calls: int) -> tuple[float, float, float]:
    """Median, min and max over `repeats` of the mean ms per call over `calls` calls, after warm-up
    (one call per repeat when a call takes over 50 ms: the full sort, at seconds per call at batch 8)."""
    jax.block_until_ready(fn(logits, state))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(logits, state))
    if time.perf_counter() - t0 > 0.05:
        calls = 1
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(logits, state)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(runs), min(runs), max(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--flat", type=float, nargs="?", const=0.5, metavar="STD",
                        help="Gaussian logits of std STD (0.5) alone: top-p and min-p keep too many tokens for the windows")
    parser.add_argument("--bf16", action="store_true", help="logits rounded through bfloat16, as an accelerator's head gives them")
    parser.add_argument("--against", metavar="SRC", help="'before' is the sampler of SRC/gemmax/engine/sampling.py, not the sort")
    args = parser.parse_args()
    if args.flat is not None and args.flat <= 0:
        parser.error(f"--flat takes a standard deviation above 0, not {args.flat}")
    before, after = choose(other_sampler(args.against) if args.against else sorted_sample), choose(_filtered_sample)
    results = []
    print(f"{'mode':<18} {'B':>2} {'before ms':>18} {'after ms':>18} {'speed-up':>8}")
    for batch in (1, 8):
        logits = lm_logits(batch, args.flat, args.bf16)
        for name, mode in MODES.items():
            state = state_for(batch, mode)
            old = time_ms(before, logits, state, args.repeats, args.calls)
            new = time_ms(after, logits, state, args.repeats, args.calls)
            results.append({"mode": name, "batch": batch, "before_ms": round(old[0], 3), "after_ms": round(new[0], 3),
                            "before_spread_ms": [round(old[1], 3), round(old[2], 3)],
                            "after_spread_ms": [round(new[1], 3), round(new[2], 3)]})
            print(f"{name:<18} {batch:>2} {old[0]:>7.3f} ({old[1]:.2f}-{old[2]:.2f}) {new[0]:>7.3f} ({new[1]:.2f}-{new[2]:.2f})"
                  f" {old[0] / new[0]:>7.1f}x")
    print(json.dumps({"benchmark": "sampling", "vocab": VOCAB, "flat": args.flat, "bf16": args.bf16,
                      "before": args.against or "the full sort", "results": results}))


if __name__ == "__main__":
    main()
