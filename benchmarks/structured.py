"""Decode tok/s with a JSON-schema constraint against without, on the built-in model (docs/structured.md).

    python benchmarks/structured.py [--quick] [--rounds 3] [--batch 1,8] [--tokens 64] [--dtype float32]

One engine (max_batch 8). Per round and batch size, `batch` requests of `tokens` generated tokens run
together, free (ignore_eos, sampled) or under a JSON schema that cannot close within `tokens` (an
array of at least 48 strings), so both generate exactly `tokens` tokens. The rate of a batch is
its decode tokens (tokens - 1 per request) over the time from the last request's first token (all
prefills done: the engine admits the batch before it decodes) to the last token, from the engine's
own timings; a request's own first-to-last window would also hold the later requests' prefills.
rounds interleave free and constrained, so both legs of a round see the same load on a shared
machine; the ratio is the median of the rounds' constrained / free ratios. Medians with min-max.
`--quick`: 5 rounds of 32 tokens. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gemmax.engine.api import Constraint, GenerationRequest, SamplingParams  # noqa: E402
from gemmax.engine.engine import BatchEngine  # noqa: E402
from gemmax.engine.loading import load_model  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "minItems": 48}


def run_batch(engine, prompt, batch: int, tokens: int, constrained: bool, seed: int) -> float:
    requests = [GenerationRequest(prompt, tokens, SamplingParams(temperature=0.8, seed=seed + i),
                                  ignore_eos=not constrained,
                                  constraint=Constraint("json_schema", json.dumps(SCHEMA)) if constrained else None)
                for i in range(batch)]
    submitted, handles = [], []
    for r in requests:  # the engine's timings count from submission, on the same perf_counter clock
        submitted.append(time.perf_counter())
        handles.append(engine.submit(r))
    results = [h.wait() for h in handles]
    for r in results:
        if r.completion_tokens != tokens:
            raise RuntimeError(f"a request stopped early ({r.finish_reason} after {r.completion_tokens} tokens)")
    first = [s + r.timings.time_to_first_token_seconds for s, r in zip(submitted, results, strict=True)]
    last = [f + r.timings.decode_seconds for f, r in zip(first, results, strict=True)]
    return batch * (tokens - 1) / (max(last) - max(first))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="5 rounds of 32 tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens = 5, 32
    batches = [int(b) for b in args.batch.split(",")]
    loaded = load_model(None, args.dtype)
    engine = BatchEngine(loaded, max_model_len=256, max_batch=max(batches), buckets=(32,)).start()
    engine.wait_ready(1200)
    prompt = tuple(loaded.tokenizer.encode("A JSON list of short words:"))
    for batch in batches:  # compile the constrained shapes outside the timed rounds
        run_batch(engine, prompt, batch, 8, True, 0)
    rates: dict[tuple[int, bool], list[float]] = {(b, c): [] for b in batches for c in (False, True)}
    started = time.perf_counter()
    for r in range(args.rounds):
        for batch in batches:
            for constrained in (False, True):
                rates[batch, constrained].append(run_batch(engine, prompt, batch, args.tokens, constrained, 100 * r))
    engine.shutdown(5)
    rows = []
    print(f"{'batch':>5} {'free tok/s':>22} {'json-schema tok/s':>22} {'ratio':>6}  (median of per-round ratios)")
    for batch in batches:
        free, cons = rates[batch, False], rates[batch, True]
        ratio = statistics.median(c / f for c, f in zip(cons, free, strict=True))
        fmt = lambda v: f"{statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})"  # noqa: E731
        print(f"{batch:>5} {fmt(free):>22} {fmt(cons):>22} {ratio:6.2f}")
        rows.append({"batch": batch, "free_tok_s": statistics.median(free), "constrained_tok_s": statistics.median(cons),
                     "free_samples": free, "constrained_samples": cons, "ratio": ratio})
    print(json.dumps({"benchmark": "structured", "model": loaded.name, "tokens": args.tokens, "rounds": args.rounds,
                      "seconds": time.perf_counter() - started, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
