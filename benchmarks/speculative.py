"""Speculative decoding against plain decoding at batch 1 (docs/speculative.md): prompt lookup on
the built-in model, or (`--draft`) a draft model on a tiny-random target / draft pair.

    python benchmarks/speculative.py [--quick] [--rounds 3] [--tokens 256] [--k 8] [--dtype float32]
    python benchmarks/speculative.py --draft [--quick] [--rounds 3] [--tokens 128] [--k 4] [--draft-layers 2]

One engine (max_batch 1, speculation on request). Two greedy workloads: rewriting a given ~500-token
text (the output copies its input: prompt lookup's case) and a free-form prompt. Per round each runs
plainly (`speculative: off`) and with prompt lookup, alternating; the outputs must be token-identical
(the benchmark fails otherwise). Rates are server-side decode rates ((tokens - 1) / first-to-last
token seconds), medians with min-max, plus the accepted-length distribution of the verify steps.
Prints a table, then one JSON line. `--quick`: one round of 64 tokens.

`--draft`: a random Gemma 3 target (transformers' initialisation, 12 layers of width 512, vocabulary
4,096) and as draft the same checkpoint with all but its first `--draft-layers` layers dropped
(same embeddings, final norm and head: it agrees with the target often, not always), both loaded
by the real loader. Greedy on random prompts, plain against draft-model speculation with k
proposals, alternating; outputs must be identical. Beside the measured speed-up it prints the one
the acceptance predicts, given the measured cost ratio c = draft decode step / target decode step
(each measured as the model's own plain decode rate in this run) and counting a verify step as one
target step: (mean accepted + 1) / (k c + 1) (Leviathan et al. 2023, eq. 1 with the measured mean).
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


DRAFT_TARGET = dict(  # Gemma 3 layout at toy width: a step costs tens of weight MB, not dispatch overhead
    vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, sliding_window=64, query_pre_attn_scalar=64,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2, max_position_embeddings=4096,
)


def write_pair(root: Path, draft_layers: int) -> tuple[Path, Path]:
    """The random target checkpoint and its first `draft_layers` layers as the draft (HF directories)."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    target = root / "target"
    Gemma3ForCausalLM(Gemma3TextConfig(**DRAFT_TARGET)).eval().save_pretrained(target)
    draft = root / "draft"
    draft.mkdir()
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=draft_layers, layer_types=config["layer_types"][:draft_layers])
    (draft / "config.json").write_text(json.dumps(config))
    for path in target.glob("*.safetensors"):
        kept = {name: value for name, value in load_file(path).items()
                if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < draft_layers}
        save_file(kept, draft / path.name, metadata={"format": "pt"})
    return target, draft


def draft_main(args) -> int:
    import tempfile

    import numpy as np

    rounds, tokens = (1, 64) if args.quick else (args.rounds, args.tokens)
    root = Path(tempfile.mkdtemp(prefix="gemmax-draft-bench-"))
    target_dir, draft_dir = write_pair(root, args.draft_layers)
    target, draft = load_model(str(target_dir), args.dtype), load_model(str(draft_dir), args.dtype)
    options = dict(max_model_len=1024, max_batch=1, buckets=(64,))
    engine = BatchEngine(target, speculation=Speculation("off", args.k), draft=draft, **options).start()
    alone = BatchEngine(draft, **options).start()  # the draft's own plain decode rate: the cost ratio
    engine.wait_ready(3600)
    alone.wait_ready(3600)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(3, DRAFT_TARGET["vocab_size"], 48)) for _ in range(3)]
    modes = {"plain": Speculation("off"), f"draft k={args.k}": Speculation("draft", args.k)}
    for spec in modes.values():  # untimed: nothing below compiles
        run(engine, prompts[0], 8, spec)
    run(alone, prompts[0], 8, Speculation("off"))
    rates = {m: [] for m in (*modes, "draft model alone")}
    lengths = [0] * (args.k + 1)
    for _ in range(rounds):
        for prompt in prompts:
            outputs = set()
            for m, spec in modes.items():
                result = run(engine, prompt, tokens, spec)
                rates[m].append(result.timings.decode_tokens_per_second)
                outputs.add(result.token_ids)
                if result.speculation is not None:
                    for n, count in enumerate(result.speculation.accepted_lengths):
                        lengths[n] += count
            if len(outputs) != 1:
                raise RuntimeError("draft-model output differs from plain decoding")
            rates["draft model alone"].append(run(alone, prompt, tokens, Speculation("off")).timings.decode_tokens_per_second)
    median = {m: statistics.median(r) for m, r in rates.items()}
    steps = sum(lengths)
    mean_accepted = sum(n * c for n, c in enumerate(lengths)) / steps
    acceptance = mean_accepted / args.k  # proposals kept / proposed (every step proposed k here)
    cost_ratio = median["plain"] / median["draft model alone"]  # draft step / target step
    predicted = (mean_accepted + 1) / (args.k * cost_ratio + 1)
    measured = median[f"draft k={args.k}"] / median["plain"]
    print(f"tiny-random Gemma 3 target ({DRAFT_TARGET['num_hidden_layers']} layers, "
          f"{target.checkpoint.weight_bytes / 2**20:.0f} MiB), draft = its first {args.draft_layers} layers "
          f"({draft.checkpoint.weight_bytes / 2**20:.0f} MiB); batch 1, greedy, {tokens} tokens, {rounds} round(s) "
          f"x {len(prompts)} prompts")
    print(f"{'mode':20} {'tok/s median':>13} {'min-max':>17}")
    for m, r in rates.items():
        print(f"{m:20} {median[m]:13.1f} {min(r):8.1f}-{max(r):<8.1f}")
    print(f"accepted proposals per verify step: {lengths} (mean {mean_accepted:.2f} of {args.k}; acceptance "
          f"{acceptance:.2f}); output identical")
    print(f"cost ratio c = draft step / target step = {cost_ratio:.3f}")
    print(f"speed-up predicted by the acceptance, (mean accepted + 1) / (k c + 1): {predicted:.2f}x; "
          f"measured: {measured:.2f}x")
    print(json.dumps({"benchmark": "speculative-draft", "tokens": tokens, "rounds": rounds, "k": args.k,
                      "draft_layers": args.draft_layers, "identical_output": True, "accepted_lengths": lengths,
                      "mean_accepted": mean_accepted, "acceptance": acceptance, "cost_ratio": cost_ratio,
                      "predicted_speedup": predicted, "measured_speedup": measured,
                      **{f"{m} tok_s": v for m, v in median.items()}}))
    engine.shutdown()
    alone.shutdown()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round of 64 tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="default: 256 (prompt lookup), 128 (--draft)")
    ap.add_argument("--k", type=int, default=None, help="default: 8 (prompt lookup), 4 (--draft)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", action="store_true", help="a draft model on a tiny-random target / draft pair")
    ap.add_argument("--draft-layers", type=int, default=2, help="--draft: the target's layers the draft keeps")
    args = ap.parse_args()
    if args.draft:
        args.tokens, args.k = args.tokens or 128, args.k or 4
        return draft_main(args)
    args.tokens, args.k = args.tokens or 256, args.k or 8
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
