"""Decode tok/s of one batch-8 decode step on one device against meshes of 8 forced host CPU devices.

    python benchmarks/mesh_decode.py [--rounds 5] [--steps 10] [--meshes dp=1,tp=8;dp=2,tp=4;dp=8,tp=1]

The 8 "devices" are XLA:CPU partitions of the same cores (this script sets
`--xla_force_host_platform_device_count=8` before importing jax), so a mesh here cannot be faster than
one device: the figure is the overhead of partitioning and of the collectives, not a speed-up.
Model: a 4-layer Gemma 4 of 1024 wide (16 heads, 8 KV heads, vocab 32,768, random float32 weights),
KV cache of 512 positions, 8 rows at position 128. Medians over rounds of `steps` back-to-back
steps; prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from gemmax.engine.mesh import MeshSpec, make_mesh, shard_params  # noqa: E402
from gemmax.model.config import FULL, SLIDING, ModelConfig  # noqa: E402
from gemmax.model.forward import forward  # noqa: E402
from gemmax.model.kv_cache import init_cache  # noqa: E402
from gemmax.model.params import random_params  # noqa: E402
from gemmax.model.sharding import cache_shardings  # noqa: E402

CONFIG = {
    "model_type": "gemma4_text", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 4096,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
    "global_head_dim": 128, "sliding_window": 256, "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
    "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
}
ROWS, MAX_LEN, CONTEXT = 8, 512, 128


def _time(mesh_text: str | None, params, config, rounds: int, steps: int) -> list[float]:
    cache = init_cache(config, ROWS, MAX_LEN)
    tokens, start, ones = jnp.ones((ROWS, 1), jnp.int32), jnp.full(ROWS, CONTEXT, jnp.int32), jnp.ones(ROWS, jnp.int32)
    if mesh_text is not None:
        mesh = make_mesh(MeshSpec.parse(mesh_text))
        params = shard_params(params, config, mesh)
        cache = jax.device_put(cache, cache_shardings(cache, mesh))
        by_row = NamedSharding(mesh, PartitionSpec("dp"))
        tokens, start, ones = (jax.device_put(a, by_row) for a in (tokens, start, ones))
    step = jax.jit(forward, static_argnames=("config",), donate_argnames=("cache",))
    logits, cache = step(params, cache, tokens, start, ones, config=config)  # compile
    jax.block_until_ready(logits)
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(params, cache, tokens, start, ones, config=config)
        jax.block_until_ready(logits)
        seconds.append((time.perf_counter() - t0) / steps)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--meshes", default="dp=1,tp=8;dp=2,tp=4;dp=4,tp=2;dp=8,tp=1")
    args = parser.parse_args()
    config = ModelConfig.from_hf_config(CONFIG)
    params = random_params(config, seed=0, weight_dtype=jnp.float32)
    rows = []
    for mesh_text in [None, *args.meshes.split(";")]:
        seconds = _time(mesh_text, params, config, args.rounds, args.steps)
        median = statistics.median(seconds)
        rows.append({"mesh": mesh_text or "1 device", "step_ms": median * 1e3,
                     "spread_ms": (max(seconds) - min(seconds)) * 1e3, "tok_s": ROWS / median})
    base = rows[0]["tok_s"]
    print(f"{'mesh':12} {'step ms':>8} {'spread':>7} {'tok/s':>8} {'vs 1 device':>11}")
    for r in rows:
        r["vs_one_device"] = r["tok_s"] / base
        print(f"{r['mesh']:12} {r['step_ms']:8.2f} {r['spread_ms']:7.2f} {r['tok_s']:8.1f} {r['vs_one_device']:10.2f}x")
    print(json.dumps({"benchmark": "mesh_decode", "cpu_cores": os.cpu_count(), "rows": rows}))


if __name__ == "__main__":
    main()
