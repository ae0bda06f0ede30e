"""Side-by-side benchmark of runtimes serving the same weights: gemmax vs the HF transformers rig
(and vLLM where it is installed), measured by the same harness from the wire.

Rigs run one at a time (start, wait for /health, sweep, stop), so they never share the CPU. Writes
one result JSON per rig, a comparison PNG and `benchmarks/rigs.md`; prints the comparison table and
ends with one JSON line.

    python benchmarks/rigs_run.py                        # the built-in model, default sweep
    python benchmarks/rigs_run.py --model /path/to/hf_dir --dtype bfloat16 --rigs gemmax,transformers
    python benchmarks/rigs_run.py --input-lens 41,521 --output-len 32 --repeats 3 --concurrency 1,2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from gemmax.bench.compare import compare_runs, to_markdown, to_rich
from gemmax.bench.plots import plot_runs
from gemmax.bench.report import print_run, wide_console, write_json
from gemmax.bench.sweep import SweepConfig, run_sweep
from gemmax.rigs.registry import RigOptions, get_rig, wait_healthy

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def bench_rig(name: str, args: argparse.Namespace, log_dir: Path) -> dict:
    options = RigOptions(model=args.model, port=free_port(), dtype=args.dtype, max_model_len=args.max_model_len,
                         max_batch=args.max_batch)
    url = f"http://127.0.0.1:{options.port}"
    log_path = log_dir / f"rig-{name}.log"
    print(f"[{name}] {shlex.join(get_rig(name).command(options))}  (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        process = get_rig(name).start(options, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, timeout_s=args.startup_timeout, process=process)
            config = SweepConfig(base_url=url, input_lens=args.input_lens, output_len=args.output_len,
                                 repeats=args.repeats, concurrency=args.concurrency, label=name,
                                 decode_source=args.decode_source, vocab_size=args.vocab_size,
                                 price_per_hour=args.price_per_hour)
            done = [0]

            def progress(record) -> None:
                done[0] += 1
                print(f"\r[{name}] {done[0]}/{config.planned_requests()} requests", end="", file=sys.stderr)

            result = run_sweep(config, progress)
            print(file=sys.stderr)
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: the built-in model)")
    parser.add_argument("--rigs", default="gemmax,transformers", help="comma-separated rig names (first = baseline)")
    parser.add_argument("--dtype", default="bfloat16", help="the same weight/activation dtype for every rig")
    parser.add_argument("--input-lens", type=ints, default=(41, 521, 2057, 3593))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=ints, default=(1,))
    parser.add_argument("--decode-source", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-batch", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=None, help="only for checkpoints without a tokenizer")
    parser.add_argument("--price-per-hour", type=float, default=None)
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--markdown", type=Path, default=HERE / "rigs.md")
    args = parser.parse_args()
    if args.model is None:
        from gemmax.weights.builtin import default_model_path

        args.model = str(default_model_path())
    args.out_dir.mkdir(parents=True, exist_ok=True)

    runs = []
    for name in args.rigs.split(","):
        result = bench_rig(name, args, args.out_dir)
        write_json(result, args.out_dir / f"rigs-{name}.json")
        print_run(result)
        runs.append(result)
    comparison = compare_runs(runs) if len(runs) > 1 else None
    plot = plot_runs(runs, args.out_dir / "rigs.png")

    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = shlex.join([sys.executable, *sys.argv])
    lines = [
        "# Rigs side by side", "",
        f"Measured {stamp} on {platform.platform()}, {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}).",
        f"Model `{args.model}`, dtype {args.dtype}, rigs run one at a time. Command:", "",
        f"    {command}", "",
        f"Result files: `{args.out_dir}/rigs-<rig>.json`; plot: `{plot.name}`.", "",
    ]
    if comparison is not None:
        lines.append(to_markdown(comparison))
        wide_console().print(to_rich(comparison))
    args.markdown.write_text("\n".join(lines) + "\n")
    print(json.dumps({"rigs": [r["label"] for r in runs], "model": args.model, "cells": [
        {"rig": r["label"], "input_len": c["input_len"], "concurrency": c["concurrency"],
         "decode_tok_s": c["stream"]["median"] if c["stream"] else None, "median_ttft_ms": c["median_ttft_ms"]}
        for r in runs for c in r["cells"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
