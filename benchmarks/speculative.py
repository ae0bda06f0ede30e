"""Speculative decoding (prompt lookup) against plain decoding on the built-in model at batch 1
(docs/speculative.md).

    python benchmarks/speculative.py [--quick] [--rounds 3] [--tokens 256] [--k 8] [--dtype float32]

One engine (max_batch 1, speculation on request). Two greedy workloads: rewriting a given ~500-token
text (the output copies its input: prompt lookup's case) and a free-form prompt. Per round each runs
plainly (`speculative: off`) and with prompt lookup, alternating; the outputs must be token-identical
(the benchmark fails otherwise). Rates are server-side decode rates ((tokens - 1) / first-to-last
token seconds), medians with min-max, plus the accepted-length distribution of the verify steps.
Prints a table, then one JSON line. `--quick`: one round of 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gemmax.engine.api import GenerationRequest, Speculation  # noqa: E402
from gemmax.engine.engine import BatchEngine  # noqa: E402
from gemmax.engine.loading import load_model  # noqa: E402

TEXT = (
    "The harbour light at the end of the northern breakwater was built in 1872, after two winters in which "
    "the fishing fleet lost eleven boats on the rocks below the cliff. The first lamp burned colza oil and "
    "was turned by a clockwork that the keeper wound every four hours; its beam reached nine miles on a "
    "clear night and rather less in the fog that rolls in from the east in late autumn. In 1904 the oil lamp "
    "was replaced by an incandescent paraffin burner, which doubled the range, and in 1931 the station was "
    "connected to the town's electricity supply, although a paraffin lamp was kept in working order until "
    "1968 in case the line failed during a storm. The keepers lived in two cottages at the foot of the tower "
    "with their families, and the logbooks they kept record the weather three times a day, every ship that "
    "passed within sight, and the small events of a life spent watching the sea: a whale stranded on the "
    "beach in 1889, a winter so cold that the harbour froze from wall to wall, the arrival of the first "
    "motor lifeboat in 1921. The last keeper left in 1987, when the light was automated and the cottages "
    "were sold. Today the tower belongs to a trust that opens it to visitors on summer weekends; from the "
    "gallery at the top one can see the whole bay, the town climbing the hill behind the harbour, and on a "
    "good day the islands twenty miles to the north. The lens, made in Paris and assembled from more than "
    "three hundred pieces of glass, still turns on its bath of mercury, and the light still flashes twice "
    "every fifteen seconds, as it has for over a century. Inside, a small museum shows the keepers' "
    "logbooks, a brass foghorn, photographs of the wrecks that led to the light being built, and a model of "
    "the tower cut open to show the stairs, the lamp room and the clockwork. The trust relies on volunteers, "
    "many of them the children and grandchildren of the keepers, who tell visitors the stories they grew up "
    "with and keep the brass polished as their parents did."
)
COPY = f"Rewrite the following text exactly as it is, word for word.\n\n{TEXT}"
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run(engine, prompt: tuple[int, ...], tokens: int, spec: Speculation):
    result = engine.submit(GenerationRequest(prompt, tokens, ignore_eos=True, speculative=spec)).wait()
    if result.completion_tokens != tokens:
        raise RuntimeError(f"a request stopped early ({result.finish_reason} after {result.completion_tokens} tokens)")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round of 64 tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    rounds, tokens = (1, 64) if args.quick else (args.rounds, args.tokens)
    loaded = load_model(None, args.dtype)
    engine = BatchEngine(loaded, max_model_len=1024, max_batch=1, buckets=(64, 512),
                         speculation=Speculation("off", args.k)).start()
    engine.wait_ready(3600)
    workloads = {"copy ~500-token text": COPY, "free-form": FREE}
    tokenizer = loaded.tokenizer
    # as a chat client sends them (the built-in model is instruction-tuned)
    prompts = {name: tuple(tokenizer.encode_chat([{"role": "user", "content": text}]))
               for name, text in workloads.items()}
    modes = {"plain": Speculation("off"), f"ngram k={args.k}": Speculation("ngram", args.k)}
    for prompt in prompts.values():  # one untimed run of each, so nothing below compiles
        for spec in modes.values():
            run(engine, prompt, 8, spec)
    rates = {(w, m): [] for w in workloads for m in modes}
    outputs, lengths = {}, {w: [0] * (args.k + 1) for w in workloads}
    for _ in range(rounds):
        for w, prompt in prompts.items():
            for m, spec in modes.items():
                result = run(engine, prompt, tokens, spec)
                rates[(w, m)].append(result.timings.decode_tokens_per_second)
                if outputs.setdefault(w, result.token_ids) != result.token_ids:
                    raise RuntimeError(f"{w}: {m} output differs from plain decoding")
                if result.speculation is not None:
                    for n, count in enumerate(result.speculation.accepted_lengths):
                        lengths[w][n] += count
    print(f"built-in model, batch 1, greedy, {tokens} tokens, {rounds} round(s), prompts "
          + ", ".join(f"{w}: {len(p)} tokens" for w, p in prompts.items()))
    print(f"{'workload':24} {'mode':12} {'tok/s median':>13} {'min-max':>17} {'speed-up':>9}")
    summary = {}
    for w in workloads:
        plain = statistics.median(rates[(w, "plain")])
        for m in modes:
            r = rates[(w, m)]
            median = statistics.median(r)
            print(f"{w:24} {m:12} {median:13.1f} {min(r):8.1f}-{max(r):<8.1f} {median / plain:8.2f}x")
            summary[f"{w} / {m}"] = {"tok_s": median, "min": min(r), "max": max(r), "speedup": median / plain}
        steps = sum(lengths[w])
        mean = sum(n * c for n, c in enumerate(lengths[w])) / steps if steps else 0.0
        print(f"{'':24} accepted proposals per verify step: {lengths[w]} (mean {mean:.2f}); output identical")
        print(f"{'':24} output: {tokenizer.decode(list(outputs[w]))[:160]!r}")
        summary[f"{w} / accepted_lengths"] = lengths[w]
    print(json.dumps({"benchmark": "speculative", "tokens": tokens, "rounds": rounds, "k": args.k,
                      "identical_output": True, **summary}))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
