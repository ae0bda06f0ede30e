"""The three-way comparison: gemmax, the HF transformers rig and vLLM serving the same weights, one
after another, measured by the same harness (`gemmax bench`'s sweep) from the wire.

Models: `builtin` (Gemma 3 270M, the built-in model's HF directory) and `e2b6` (random Gemma 4
E2B-shaped weights with 6 layers, benchmarks/decode.py's checkpoint, saved in bfloat16 with the
built-in tokenizer beside it so every rig counts and detokenizes the same ids). Per model and rig:

1. start the rig and time launch -> /health 200 (`startup_s`: process start, imports, weight load,
   compilation / warm-up: what a user waits for);
2. a quality check: the prompt "The capital of France is" (its ids from the rig's own /tokenize) and
   CHECK_TOKENS greedy tokens, compared with transformers float32 run in this process on the same
   checkpoint: `prompt_ids_match`, `agree_prefix` (leading tokens equal to the reference) and the
   degeneracy verdict (gemmax.engine.degeneracy). A rig whose output is degenerate where the
   reference's is not is reported as such and not timed;
3. the sweep: inputs 41 / 521 / 2057 tokens at each `--concurrency` level (default 1 and 8): at 1,
   `--repeats` measured requests after a warm-up request; at the others, `--repeats-batched` measured
   rounds after a warm-up round; 64 forced output tokens (ignore_eos + min_tokens), greedy;
4. for each `--sampling` setting, at `--sampled-input-lens`: a greedy sweep, then the same sweep
   with that sampling (the result's `sampled` list, each entry with its `greedy_cells`), so every
   sampled figure has a greedy one measured just before it in the same server process;
5. stop it.

Rigs run one at a time, so they never share the CPU with each other. Writes
`results/rigs-<model>-<rig>.json` (the sweep result plus a `rig` entry: command, dtype, startup,
quality), `results/rigs-<model>.png`, the rig logs `results/rig-<model>-<rig>.log` and
`benchmarks/rigs.md`; prints the tables and ends with one JSON line.

    python benchmarks/rigs_run.py                                   # both models, all three rigs
    python benchmarks/rigs_run.py --models builtin --rigs gemmax,vllm --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gemmax.bench.compare import compare_runs, to_markdown, to_rich
from gemmax.bench.plots import plot_runs
from gemmax.bench.report import print_run, wide_console, write_json
from gemmax.bench.sweep import SweepConfig, parse_sampling, run_sweep, sampling_name
from gemmax.engine.degeneracy import check_degeneracy
from gemmax.rigs.registry import RigOptions, free_port, get_rig, wait_healthy

HERE = Path(__file__).parent
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SAMPLINGS = ("temperature=1.0", "temperature=0.7,top_p=0.9", "temperature=1.0,top_k=40", "temperature=1.0,min_p=0.05")
MODELS = {"builtin": "Gemma 3 270M (the built-in model, Q4_K_M GGUF dequantised)",
          "e2b6": "Gemma 4 E2B-shaped, 6 layers, random weights (seed 0)"}


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def model_path(name: str) -> Path:
    from gemmax.weights.builtin import default_model_path

    builtin = default_model_path()
    if name == "builtin":
        return builtin
    from platformdirs import user_cache_dir

    target = Path(user_cache_dir("gemmax")) / "bench" / "e2b6-seed0"
    if not (target / "model.safetensors").is_file():
        sys.path.insert(0, str(HERE))
        from decode import build_checkpoint

        print(f"[e2b6] building the random E2B-shaped 6-layer checkpoint in {target}", file=sys.stderr)
        staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        build_checkpoint(staging)
        for file in TOKENIZER_FILES:
            shutil.copy(builtin / file, staging / file)
        os.replace(staging, target)
    return target


def reference_tokens(path: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) from transformers float32 in this process: AutoTokenizer on the
    checkpoint's own tokenizer files, CHECK_TOKENS tokens with eos suppressed as the rigs are asked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(path)(CHECK_PROMPT).input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=CHECK_TOKENS, min_new_tokens=CHECK_TOKENS,
                             do_sample=False)
    del model
    gc.collect()
    return prompt, out[0, len(prompt):].tolist()


def quality_check(url: str, reference: tuple[list[int], list[int]]) -> dict:
    """The rig's prompt ids and greedy tokens for CHECK_PROMPT against the transformers float32 reference."""
    ref_prompt, ref_out = reference
    with httpx.Client(base_url=url, timeout=600.0) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        prompt_ids = client.post("/tokenize", json={"model": model, "prompt": CHECK_PROMPT}).json()["tokens"]
        ids: list[int] = []
        text = ""
        payload = {"model": model, "prompt": CHECK_PROMPT, "max_tokens": CHECK_TOKENS, "temperature": 0.0,
                   "ignore_eos": True, "min_tokens": CHECK_TOKENS, "return_token_ids": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=payload) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    ids += choice.get("token_ids") or []
                    text += choice.get("text") or ""
    agree = next((i for i, (a, b) in enumerate(zip(ids, ref_out, strict=False)) if a != b), min(len(ids), len(ref_out)))
    verdict, ref_verdict = check_degeneracy(ids), check_degeneracy(ref_out)
    return {"prompt": CHECK_PROMPT, "prompt_ids": prompt_ids, "prompt_ids_match": prompt_ids == ref_prompt,
            "token_ids": ids, "text": text, "reference_token_ids": ref_out, "agree_prefix": agree,
            "tokens": len(ids), "degenerate": verdict.degenerate, "degenerate_reason": verdict.reason,
            "reference_degenerate": ref_verdict.degenerate,
            "judged_degenerate": verdict.degenerate and not ref_verdict.degenerate}


def bench_rig(model: str, path: Path, name: str, args: argparse.Namespace, reference) -> dict:
    options = RigOptions(model=str(path), port=free_port(), dtype=args.dtype, max_model_len=args.max_model_len,
                         max_batch=max(args.concurrency))
    rig = get_rig(name)
    url = f"http://127.0.0.1:{options.port}"
    log_path = args.out_dir / f"rig-{model}-{name}.log"
    if rig.prepare is not None:
        rig.prepare()  # the vLLM environment, created once (not counted in start-up)
    command = rig.command(options)
    print(f"[{model}/{name}] {shlex.join(command)}  (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        process = rig.start(options, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(url, timeout_s=args.startup_timeout, process=process)
            except (RuntimeError, TimeoutError) as exc:  # reported, and the other rigs still run
                print(f"[{model}/{name}] failed to start: {exc}", file=sys.stderr)
                return {"label": name, "cells": [], "not_timed": f"failed to start: {exc}",
                        "rig": {"name": name, "command": command, "dtype": args.dtype, "startup_s": None,
                                "quality": None}}
            startup = time.perf_counter() - t0
            print(f"[{model}/{name}] ready in {startup:.1f} s", file=sys.stderr)
            quality = quality_check(url, reference)
            print(f"[{model}/{name}] quality: agree {quality['agree_prefix']}/{quality['tokens']}, prompt ids "
                  f"match {quality['prompt_ids_match']}, degenerate {quality['degenerate']}: {quality['text'][:80]!r}",
                  file=sys.stderr)
            info = {"name": name, "command": command, "dtype": args.dtype, "startup_s": round(startup, 1),
                    "quality": quality}
            if quality["judged_degenerate"]:
                return {"label": name, "rig": info, "cells": [], "not_timed": "degenerate output"}
            result = sweep_levels(url, name, args, args.input_lens, ())
            result["sampled"] = []
            for sampling in args.sampling:
                # Greedy again right before each setting, at the same inputs: the ratio compares two
                # sweeps a minute apart, not the greedy sweep of minutes before (this machine's
                # bandwidth has swung 2x within a minute).
                greedy = sweep_levels(url, name, args, args.sampled_input_lens, ())
                part = sweep_levels(url, name, args, args.sampled_input_lens, sampling)
                result["sampled"].append({"sampling": sampling_name(sampling), "cells": part["cells"],
                                          "greedy_cells": greedy["cells"]})
                print(f"[{model}/{name}] {sampling_name(sampling)} done", file=sys.stderr)
            result["rig"] = info
            return result
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def sweep_levels(url: str, name: str, args: argparse.Namespace, input_lens: tuple[int, ...], sampling) -> dict:
    """One sweep result over every `--concurrency` level, one sweep per level (`--repeats` measured
    requests at c=1, `--repeats-batched` measured rounds at the others), merged: the cells of all,
    the server's state before the first and after the last (the degenerate-response delta over all of
    them), each level's config and probe under `parts`."""
    result = None
    for concurrency in sorted(set(args.concurrency)):
        repeats = args.repeats if concurrency == 1 else args.repeats_batched
        config = SweepConfig(base_url=url, input_lens=input_lens, output_len=args.output_len, repeats=repeats,
                             concurrency=(concurrency,), label=name, decode_source="stream", sampling=sampling)
        part = run_sweep(config)
        level = {"concurrency": concurrency, "config": part["config"], "probe": part["probe"]}
        if result is None:
            result = {**part, "parts": [level]}
        else:
            result["cells"] += part["cells"]
            result["parts"].append(level)
            result["finished"] = part["finished"]
            server, last = result["server"], part["server"]
            for key in ("health_after", "precision_after", "degenerate_responses_after"):
                server[key] = last[key]
            before, after = server["degenerate_responses_before"], server["degenerate_responses_after"]
            server["degenerate_responses_delta"] = None if before is None or after is None else after - before
        print(f"[{name}] {sampling_name(sampling)} c={concurrency} done", file=sys.stderr)
        if part["aborted"]:  # the server stopped answering: what was measured is kept, the rest not tried
            result["aborted"] = part["aborted"]
            break
    result["config"] = {**result["config"], "concurrency": sorted(set(args.concurrency))}
    return result


def sampled_table(runs: list[dict]) -> list[str]:
    """Markdown: per rig and sampling setting, wire decode tok/s at c=1 and output tok/s at c=8, each
    beside the greedy figure measured just before it (`greedy_cells`; older results: the rig's main
    greedy sweep) and their ratio."""
    lines = ["| rig | sampling | input | c=1 decode tok/s | greedy | ratio | c=8 output tok/s | greedy | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for part in run.get("sampled", []):
            greedy = {(c["input_len"], c["concurrency"]): c for c in part.get("greedy_cells", run["cells"])}
            for input_len in sorted({c["input_len"] for c in part["cells"]}):
                cells = {c["concurrency"]: c for c in part["cells"] if c["input_len"] == input_len}
                row = [run["label"], part["sampling"], str(input_len)]
                for concurrency, figure in ((1, lambda c: (c["stream"] or {}).get("median")),
                                            (8, lambda c: c["output_throughput"])):
                    cell, base = cells.get(concurrency), greedy.get((input_len, concurrency))
                    value = figure(cell) if cell else None
                    ref = figure(base) if base else None
                    row += [f"{value:.1f}" if value else "", f"{ref:.1f}" if ref else "",
                            f"{value / ref:.2f}" if value and ref else ""]
                lines.append("| " + " | ".join(row) + " |")
    return lines


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def report(models: list[str], rigs: list[str], args: argparse.Namespace, header: list[str]) -> list[str]:
    """benchmarks/rigs.md from the result files on disk (so a partial run still reports what finished)."""
    lines = list(header)
    for model in models:
        runs = [r for name in rigs if (r := load(args.out_dir / f"rigs-{model}-{name}.json")) is not None]
        if not runs:
            continue
        missing = [name for name in rigs if name not in [r["label"] for r in runs]]
        lines += [f"## {model}: {MODELS[model]}", "", f"Checkpoint `{runs[0]['rig']['command'][runs[0]['rig']['command'].index('--model') + 1]}`.", ""]
        if missing:
            lines += [f"Not run on this model: {', '.join(missing)}.", ""]
        lines += ["| rig | launch to ready | prompt ids = transformers' | greedy tokens equal to transformers float32 "
                  "| degenerate | output |", "|---|---:|---|---:|---|---|"]
        for r in runs:
            q = r["rig"]["quality"]
            if q is None:
                lines.append(f"| {r['label']} | {r['not_timed']} | | | | |")
                continue
            lines.append(f"| {r['label']} | {r['rig']['startup_s']:.1f} s | {q['prompt_ids_match']} | "
                         f"{q['agree_prefix']}/{q['tokens']} | {q['degenerate']}"
                         f"{' (not timed)' if q['judged_degenerate'] else ''} | {json.dumps(q['text'][:60])} |")
        lines.append("")
        timed = [r for r in runs if r["cells"]]
        if len(timed) > 1:
            comparison = compare_runs(timed)
            lines.append(to_markdown(comparison))
            wide_console().print(to_rich(comparison, title=f"{model}: {MODELS[model]}"))
        if any(r.get("sampled") for r in timed):
            lines += ["Sampled decode against greedy measured just before it (same server process, same harness):", "",
                      *sampled_table(timed), ""]
        if timed:
            plot = plot_runs(timed, args.out_dir / f"rigs-{model}.png")
            lines += ["", f"Plot: `results/{plot.name}`; result files `results/rigs-{model}-<rig>.json`.", ""]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,e2b6", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--rigs", default="gemmax,transformers,vllm", help="comma-separated rig names (first = baseline)")
    parser.add_argument("--dtype", default="bfloat16", help="the same weight/activation dtype for every rig")
    parser.add_argument("--input-lens", type=ints, default=(41, 521, 2057))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=ints, default=(1, 8))
    parser.add_argument("--repeats", type=int, default=4, help="measured requests per cell at concurrency 1")
    parser.add_argument("--repeats-batched", type=int, default=1, help="measured rounds at each concurrency above 1")
    parser.add_argument("--sampling", type=lambda text: tuple(parse_sampling(t) for t in text.split(";") if t.strip()),
                        default=tuple(parse_sampling(t) for t in SAMPLINGS),
                        help="';'-separated sampling settings (name=value,...), each measured after its own greedy "
                             "sweep; '' for none")
    parser.add_argument("--sampled-input-lens", type=ints, default=(41,))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--markdown", type=Path, default=HERE / "rigs.md")
    parser.add_argument("--note", default="", help="a line for the markdown (e.g. what else ran on the machine)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the markdown from the result files")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rigs, models = args.rigs.split(","), args.models.split(",")

    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    header = ["# Rigs side by side: gemmax, transformers, vLLM", "",
              f"Written {stamp} on {platform.platform()}, {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}); "
              f"dtype {args.dtype} for every rig; rigs run one at a time unless the note below says otherwise. Command:", "",
              f"    {shlex.join([sys.executable, *sys.argv])}", ""]
    if args.note:
        header += [args.note, ""]
    if args.report_only:
        args.markdown.write_text("\n".join(report(models, rigs, args, header)) + "\n")
        return 0
    summary = []
    for model in models:
        path = model_path(model)
        reference = reference_tokens(path)
        for name in rigs:
            result = bench_rig(model, path, name, args, reference)
            result["label"] = name
            write_json(result, args.out_dir / f"rigs-{model}-{name}.json")
            if result["cells"]:
                print_run(result)
            args.markdown.write_text("\n".join(report(models, rigs, args, header)) + "\n")  # after every rig
            summary.append({"model": model, "rig": name, "startup_s": result["rig"]["startup_s"],
                            "agree_prefix": (result["rig"]["quality"] or {}).get("agree_prefix"),
                            "not_timed": result.get("not_timed"),
                            "cells": [{"input_len": c["input_len"], "concurrency": c["concurrency"],
                                       "decode_tok_s": c["stream"]["median"] if c["stream"] else None,
                                       "median_ttft_ms": c["median_ttft_ms"]} for c in result["cells"]]})
    print(json.dumps({"rigs": rigs, "runs": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
