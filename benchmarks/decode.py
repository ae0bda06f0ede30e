"""Decode speed: gemmax vs transformers on the same random E2B-shaped weights, in one process.

The model is Gemma 4 E2B with 6 layers instead of 35 (hidden 1536, 8 heads, 1 KV head, head_dim
256 / 512, FFN 6144 (12288 on the KV-sharing layers), vocab 262144, PLE 256, KV sharing). Weights
are random, built once by transformers and saved; gemmax loads the saved file with its real loader.

For each runtime it times decode steps at a fixed context after warm-up (median of `--repeats`
timed runs of `--steps` steps) at batch 1 and batch 8, and reports tokens/s and, for gemmax, the
share of the memory-bandwidth roofline: bytes one step must read (weights actually read, the tied
LM head once, PLE/embedding rows gathered, KV at the context) over the all-core read bandwidth
measured in the same run. It also reports gemmax's own per-request decode gauge from the batching
engine (host loop, sampling and streaming included) at batch 1.

    python benchmarks/decode.py [--steps 32] [--repeats 3] [--context 128] [--skip-f32]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build_checkpoint(directory: Path) -> None:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemmax.model.config import E2B_SIX_LAYER_CONFIG

    hf = {k: v for k, v in E2B_SIX_LAYER_CONFIG.items() if k != "model_type"}
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**hf, attn_implementation="sdpa")).eval()
    model.to(torch.bfloat16).save_pretrained(directory)


def time_steps(step, steps: int, repeats: int) -> float:
    """Median seconds per step over `repeats` runs of `steps` chained steps (after one warm-up run)."""
    step(steps)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(steps)
        runs.append((time.perf_counter() - t0) / steps)
    return statistics.median(runs)


def gemmax_step_runner(loaded, batch: int, context: int):
    import jax
    import jax.numpy as jnp

    from gemmax.engine.shapes import kv_buckets
    from gemmax.engine.steps import decode_step, init_device_state

    config, precision = loaded.checkpoint.config, loaded.policy.precision()
    device = init_device_state(config, batch, context + 4096, precision)
    state = {"device": dataclasses.replace(device, tokens=jnp.full(batch, 5, jnp.int32),
                                           positions=jnp.full(batch, context, jnp.int32),
                                           remaining=jnp.full(batch, 1 << 30, jnp.int32))}
    want = jnp.zeros(batch, jnp.bool_)
    kv_len = kv_buckets(context + 4096)  # as the engine passes them: the step reads the bucket that holds the context

    def run(steps: int) -> None:
        for _ in range(steps):
            device, _ = decode_step(loaded.checkpoint.params, state["device"], want, config=config,
                                    precision=precision, kv_len=kv_len)
            state["device"] = dataclasses.replace(device, positions=device.positions - 1)  # same context every step
        jax.block_until_ready(state["device"].tokens)

    return run


def hf_step_runner(model, batch: int, context: int):
    import torch

    ids = torch.randint(3, 1000, (batch, context))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    past = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)

    def run(steps: int) -> None:
        # Each timed run starts from a copy of the same prefilled cache (a few MB; copying it is
        # negligible next to the steps), so every run decodes at the same context.
        with torch.no_grad():
            cache = copy.deepcopy(past)
            nonlocal token
            for _ in range(steps):
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)

    return run


def engine_gauge(loaded, context: int, steps: int) -> float:
    from gemmax.engine.api import GenerationRequest
    from gemmax.engine.engine import BatchEngine

    engine = BatchEngine(loaded, max_model_len=context + steps + 8, max_batch=1, buckets=(context,)).start()
    engine.wait_ready()
    try:
        prompt = tuple(range(10, 10 + context))
        results = [engine.submit(GenerationRequest(prompt, steps, ignore_eos=True)).wait() for _ in range(3)]
    finally:
        engine.shutdown(5)
    return statistics.median(r.timings.decode_tokens_per_second for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--skip-f32", action="store_true", help="skip transformers float32 (needs ~4.5 GB more)")
    parser.add_argument("--checkpoint", type=Path, help="reuse a checkpoint directory built by an earlier run")
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    from gemmax.engine.loading import load_model
    from gemmax.engine.memory import decode_traffic, measure_read_bandwidth

    torch.set_num_threads(os.cpu_count() or 1)
    tmp = None
    directory = args.checkpoint
    if directory is None or not (directory / "config.json").is_file():
        if directory is None:
            tmp = tempfile.TemporaryDirectory()
            directory = Path(tmp.name)
        build_checkpoint(directory)

    loaded = load_model(str(directory), "auto")
    bandwidth = measure_read_bandwidth()
    rows, results = [], {}
    for batch in (1, 8):
        seconds = time_steps(gemmax_step_runner(loaded, batch, args.context), args.steps, args.repeats)
        traffic = decode_traffic(loaded.checkpoint.config, loaded.checkpoint.params, batch, args.context,
                                 loaded.policy.precision().kv_cache)
        roofline = bandwidth * 1e9 / traffic.total  # steps/s if every byte were read at full bandwidth
        results[f"gemmax_b{batch}"] = {"tok_s": batch / seconds, "step_ms": seconds * 1e3,
                                       "bytes_per_step": traffic.total, "roofline_share": (1 / seconds) / roofline}
    results["gemmax_engine_b1_gauge"] = {"tok_s": engine_gauge(loaded, args.context, args.steps)}
    dtypes = [("bfloat16", torch.bfloat16)] + ([] if args.skip_f32 else [("float32", torch.float32)])
    for name, dtype in dtypes:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        for batch in (1, 8):
            seconds = time_steps(hf_step_runner(model, batch, args.context), args.steps, args.repeats)
            results[f"transformers_{name}_b{batch}"] = {"tok_s": batch / seconds, "step_ms": seconds * 1e3}
        del model

    table = Table(title=f"decode, E2B-shaped 6-layer model, context {args.context}, read bandwidth {bandwidth:.1f} GB/s")
    for column in ("runtime", "batch", "tok/s", "ms/step", "bytes/step", "roofline share"):
        table.add_column(column, justify="right")
    for key, r in results.items():
        runtime, _, batch = key.rpartition("_b")
        if key == "gemmax_engine_b1_gauge":
            runtime, batch = "gemmax engine (per-request gauge)", "1"
        rows.append(key)
        table.add_row(runtime, batch, f"{r['tok_s']:.2f}", f"{r.get('step_ms', float('nan')):.1f}",
                      f"{r['bytes_per_step'] / 1e6:.0f} MB" if "bytes_per_step" in r else "",
                      f"{100 * r['roofline_share']:.0f}%" if "roofline_share" in r else "")
    Console().print(table)
    best_hf_b1 = max(v["tok_s"] for k, v in results.items() if k.startswith("transformers") and k.endswith("_b1"))
    best_hf_b8 = max(v["tok_s"] for k, v in results.items() if k.startswith("transformers") and k.endswith("_b8"))
    summary = {
        "bandwidth_gb_s": bandwidth, "context": args.context, "results": results,
        "b1_vs_best_transformers": results["gemmax_b1"]["tok_s"] / best_hf_b1,
        "b8_vs_best_transformers": results["gemmax_b8"]["tok_s"] / best_hf_b8,
        "b8_over_b1": results["gemmax_b8"]["tok_s"] / results["gemmax_b1"]["tok_s"],
    }
    print(f"gemmax b1 / best transformers b1: {summary['b1_vs_best_transformers']:.2f}x; "
          f"b8 / best transformers b8: {summary['b8_vs_best_transformers']:.2f}x; gemmax b8 / b1: {summary['b8_over_b1']:.2f}x")
    print(json.dumps(summary))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
