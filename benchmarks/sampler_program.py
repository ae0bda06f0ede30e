"""The whole sampler program (`engine.sampling.sample`: penalties, the draw, logprobs, counts) of this
tree against another version's, side by side in one process: what each costs to compile, how large
it is, and how long a call takes.

For batch 1 and 8 over [B, 262144] f32 logits (language-model-like, as `benchmarks/sampling.py`
makes them), each version's `sample` is lowered and compiled (seconds, lines of optimised HLO,
megabytes of the serialised executable: what a warm start loads), then called in each mode: greedy,
greedy with repetition penalty 1.1, temperature 1.0, 0.7 with top_p 0.9, top_k 40, min_p 0.05. The
versions alternate `--rounds` times, each first in every other round (this machine's speed drifts, and
a process's first compile is slower); each figure is the median over the rounds of the median over
`--repeats` of the mean over `--calls` calls.

    python benchmarks/sampler_program.py --against OTHER/src [--rounds 3] [--repeats 5] [--calls 10]

OTHER/src is a source tree (a `git worktree` of an earlier commit, or a copy of its
gemmax/engine/sampling.py under OTHER/src/gemmax/engine/). Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import gemmax.engine.sampling as this_sampling
from sampling import VOCAB, lm_logits, state_for, time_ms

MODES = {  # temperature, top_k, top_p, min_p, repetition
    "greedy": (0.0, 0, 1.0, 0.0, 1.0),
    "greedy, repetition 1.1": (0.0, 0, 1.0, 0.0, 1.1),
    "temperature 1.0": (1.0, 0, 1.0, 0.0, 1.0),
    "0.7 + top_p 0.9": (0.7, 0, 0.9, 0.0, 1.0),
    "top_k 40": (1.0, 40, 1.0, 0.0, 1.0),
    "min_p 0.05": (1.0, 0, 1.0, 0.05, 1.0),
}


def load_sampling(src: str):
    """OTHER/src/gemmax/engine/sampling.py loaded as its own module."""
    spec = importlib.util.spec_from_file_location("other_sampling", Path(src) / "gemmax/engine/sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_state(batch: int, mode: tuple) -> this_sampling.SamplingState:
    """`state_for`'s settings with the repetition penalty, and counts and prompt masks of the vocabulary's size."""
    *settings, repetition = mode
    state = state_for(batch, tuple(settings))
    return dataclasses.replace(state, repetition=jnp.full(batch, repetition, jnp.float32),
                               output_counts=jnp.zeros((batch, VOCAB), jnp.int32),
                               prompt_mask=jnp.zeros((batch, VOCAB), jnp.bool_))


def compiled(module, logits, state, want):
    """(the compiled `sample` of `module`, compile seconds with lowering, HLO lines, executable MB)."""
    t0 = time.perf_counter()
    program = jax.jit(lambda x, s, w: module.sample(x, s, w)).lower(logits, state, want).compile()
    seconds = time.perf_counter() - t0
    size = len(program.runtime_executable().serialize()) / 2**20
    return program, seconds, len(program.as_text().splitlines()), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="SRC", help="the other version's source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    versions = {"before": load_sampling(args.against), "after": this_sampling}
    rows = []
    for batch in (1, 8):
        logits = lm_logits(batch, None)
        want = jnp.zeros(batch, jnp.bool_)
        seen = {name: {"compile_s": [], "ms": {mode: [] for mode in MODES}} for name in versions}
        for round_ in range(args.rounds):
            order = list(versions.items())  # each version first in every other round
            for name, module in order[::-1] if round_ % 2 else order:
                program, seconds, lines, size = compiled(module, logits, full_state(batch, MODES["greedy"]), want)
                seen[name].update(hlo_lines=lines, executable_mb=round(size, 2))
                seen[name]["compile_s"].append(seconds)
                def call(x, s, program=program, want=want):
                    return program(x, s, want)

                for mode, settings in MODES.items():
                    seen[name]["ms"][mode].append(time_ms(call, logits, full_state(batch, settings), args.repeats,
                                                          args.calls)[0])
        for name, got in seen.items():
            rows.append({"version": name, "batch": batch, "compile_s": round(statistics.median(got["compile_s"]), 2),
                         "compile_spread_s": [round(min(got["compile_s"]), 2), round(max(got["compile_s"]), 2)],
                         "hlo_lines": got["hlo_lines"], "executable_mb": got["executable_mb"],
                         "ms": {mode: round(statistics.median(v), 3) for mode, v in got["ms"].items()},
                         "ms_spread": {mode: [round(min(v), 3), round(max(v), 3)] for mode, v in got["ms"].items()}})
    header = ["version", "B", "compile s", "HLO lines", "exe MB", *MODES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [row["version"], row["batch"], row["compile_s"], row["hlo_lines"], row["executable_mb"],
                 *(f"{row['ms'][mode]:.3f}" for mode in MODES)]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print("(ms per call, median over rounds; compile: lowering and XLA, median over rounds)")
    print(json.dumps({"benchmark": "sampler_program", "vocab": VOCAB, "against": args.against, "rounds": args.rounds,
                      "results": rows}))


if __name__ == "__main__":
    main()
