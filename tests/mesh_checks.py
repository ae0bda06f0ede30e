"""The mesh checks, run by tests/test_mesh.py in ONE subprocess with 8 forced host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, which must be set before jax is imported).

    python tests/mesh_checks.py CHECKPOINTS_JSON OUT_JSON

CHECKPOINTS_JSON maps config names to HF checkpoint directories (written by transformers in the
parent). For every config and mesh the script records, against one device: the max |logit diff| of a
prefill of 8 rows and of 4 decode steps (float32), and the greedy tokens of 8 requests through the
batching engine (two meshes per config). It records the collectives of the compiled decode step on
a tp mesh, and runs `gemmax profile --mesh` once. The parent asserts; this script only measures.
"""

from __future__ import annotations

import json
import os
import sys
import time

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    raise SystemExit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from gemmax.engine.api import GenerationRequest  # noqa: E402
from gemmax.engine.engine import BatchEngine  # noqa: E402
from gemmax.engine.generate import generate  # noqa: E402
from gemmax.engine.hlo import HloIndex  # noqa: E402
from gemmax.engine.loading import load_model  # noqa: E402
from gemmax.engine.mesh import MeshSpec, make_mesh, mesh_steps, shard_params, state_shardings  # noqa: E402
from gemmax.engine.steps import init_device_state  # noqa: E402
from gemmax.model.forward import Precision, forward  # noqa: E402
from gemmax.model.kv_cache import init_cache  # noqa: E402
from gemmax.model.params import param_specs  # noqa: E402
from gemmax.model.sharding import cache_shardings  # noqa: E402
from gemmax.weights.load import load_checkpoint  # noqa: E402

ROWS, MAX_LEN, PROMPT = 8, 64, 12
MESHES = ["dp=1,tp=8", "dp=2,tp=4", "dp=4,tp=2", "dp=8,tp=1"]
EP_MESHES = ["dp=1,tp=1,ep=8", "dp=2,tp=2,ep=2"]


def _forward_run(params, config, mesh=None):
    """Prefill 8 rows of different lengths, then 4 greedy decode steps: (logits [5, 8, V], tokens)."""
    rng = np.random.default_rng(0)
    lengths = np.asarray([PROMPT - (i % 5) for i in range(ROWS)], np.int32)
    tokens = rng.integers(3, config.vocab_size, (ROWS, PROMPT)).astype(np.int32)
    cache = init_cache(config, ROWS, MAX_LEN)
    rows = lambda a: a  # noqa: E731
    if mesh is not None:
        cache = jax.device_put(cache, cache_shardings(cache, mesh))
        by_row = NamedSharding(mesh, PartitionSpec("dp"))
        rows = lambda a: jax.device_put(a, by_row)  # noqa: E731
    step = jax.jit(forward, static_argnames=("config", "logits"), donate_argnames=("cache",))
    logits, cache = step(params, cache, rows(jnp.asarray(tokens)), rows(jnp.zeros(ROWS, jnp.int32)),
                         rows(jnp.asarray(lengths)), config=config, logits="last")
    out = [np.asarray(logits)]
    start = lengths
    for _ in range(4):
        next_ids = np.argmax(out[-1], -1).astype(np.int32)[:, None]
        logits, cache = step(params, cache, rows(jnp.asarray(next_ids)), rows(jnp.asarray(start)),
                             rows(jnp.ones(ROWS, jnp.int32)), config=config, logits="last")
        out.append(np.asarray(logits))
        start = start + 1
    return np.stack(out), np.argmax(np.stack(out), -1).tolist()


def _prompts(vocab):
    """8 prompts of one length (so the one-device reference compiles one prefill), different tokens."""
    rng = np.random.default_rng(1)
    return [tuple(int(t) for t in rng.integers(3, vocab, 9)) for _ in range(ROWS)]


def _engine_tokens(loaded, spec):
    """Greedy tokens of 8 requests (9-token prompts, 10..17 new tokens) through the batching engine on
    `spec`, all submitted at once (`loaded`: the model as loaded for a mesh, shared by every engine)."""
    engine = BatchEngine(loaded, max_model_len=MAX_LEN, max_batch=ROWS, buckets=(16,), steps_per_dispatch=4,
                         mesh=spec, warm_up=False).start()
    assert engine.wait_ready(600), engine.error
    prompts = _prompts(loaded.checkpoint.config.vocab_size)
    handles = [engine.submit(GenerationRequest(p, max_tokens=10 + i, ignore_eos=True)) for i, p in enumerate(prompts)]
    tokens = [list(h.wait().token_ids) for h in handles]
    engine.shutdown(drain_timeout=5)
    return tokens


def _reference_tokens(ck):
    """The same requests, each alone through the one-device reference path (`gemmax generate`)."""
    return [generate(ck.params, ck.config, list(p), 10 + i, stop_ids=()) for i, p in enumerate(_prompts(ck.config.vocab_size))]


def _hlo_collectives(ck, spec):
    """Collectives of the compiled full-batch decode step on a tp mesh: each all-reduce with the named
    scope it came from, and each all-gather's result dims, next to the shapes of the weight matrices."""
    mesh = make_mesh(spec)
    config, precision = ck.config, Precision()
    plan = mesh_steps(mesh, config, ROWS, MAX_LEN, precision)
    params = shard_params(ck.params, config, mesh)
    device = jax.device_put(init_device_state(config, ROWS, MAX_LEN, precision),
                            state_shardings(jax.eval_shape(lambda: init_device_state(config, ROWS, MAX_LEN, precision)),
                                            mesh))
    compiled = plan.decode_step.lower(params, device, jnp.zeros(ROWS, bool), config=config, precision=precision,
                                      kv_len=MAX_LEN).compile()
    index = HloIndex.from_compiled(compiled)
    ops = [i for i in index.instrs.values() if i.opcode.startswith(("all-reduce", "all-gather", "reduce-scatter",
                                                                     "all-to-all", "collective-permute"))]
    return {
        "layers": config.num_layers,
        "all_reduce": [i.op_name for i in ops if i.opcode in ("all-reduce", "all-reduce-start")],
        "all_gather_dims": [list(i.dims) for i in ops if i.opcode in ("all-gather", "all-gather-start")],
        "other": sorted({i.opcode for i in ops} - {"all-reduce", "all-reduce-start", "all-reduce-done", "all-gather",
                                                     "all-gather-start", "all-gather-done"}),
        "weight_shapes": sorted({list(s.shape).__repr__() for s in param_specs(config) if len(s.shape) >= 2}),
    }


# The engine runs on two meshes per config (its warm-up compiles ~6 programs per mesh); the forward
# runs on every mesh.
ENGINE_MESHES = {"e4b_like": ["dp=2,tp=4", "dp=1,tp=8"], "31b_like": ["dp=4,tp=2", "dp=8,tp=1"],
                 "26b_a4b_like": ["dp=2,tp=2,ep=2", "dp=1,tp=1,ep=8"]}
HLO_MESH = {"31b_like": "dp=1,tp=4", "e4b_like": "dp=1,tp=8"}
PROFILE = ("31b_like", "dp=2,tp=4")  # `gemmax profile --mesh`, through the command line


def _profile(directory, mesh: str, out_dir: str) -> dict:
    """`gemmax profile --mesh` (3 traced decode steps of 8 rows): its exit code, output and report."""
    from typer.testing import CliRunner

    from gemmax.cli import app

    result = CliRunner().invoke(app, ["profile", "--model", directory, "--dtype", "float32", "--mesh", mesh,
                                      "--batch", str(ROWS), "--steps", "3", "--warmup", "1", "--context", "16",
                                      "--out", out_dir])
    report = None
    if result.exit_code == 0:
        with open(os.path.join(out_dir, "profile.json")) as f:
            report = json.load(f)
    return {"exit_code": result.exit_code, "output": result.output[:4000], "report": report}  # the table first


def main(checkpoints_json: str, out_json: str) -> None:
    with open(checkpoints_json) as f:
        checkpoints = json.load(f)
    assert len(jax.devices()) == 8, jax.devices()
    results = {"forward": {}, "engine": {}, "hlo": {}, "profile": None}
    started = time.perf_counter()
    for name, directory in checkpoints.items():
        ck = load_checkpoint(directory, weight_dtype=jnp.float32)
        reference, reference_greedy = _forward_run(ck.params, ck.config)
        for text in MESHES + (EP_MESHES if ck.config.has_moe else []):
            mesh = make_mesh(MeshSpec.parse(text))
            got, greedy = _forward_run(shard_params(ck.params, ck.config, mesh), ck.config, mesh)
            results["forward"][f"{name} {text}"] = {"max_diff": float(np.abs(got - reference).max()),
                                                    "greedy": greedy, "one_device": reference_greedy}
            print(name, text, results["forward"][f"{name} {text}"]["max_diff"],
                  f"{time.perf_counter() - started:.0f}s", flush=True)
        if name in ENGINE_MESHES:
            # plain arrays (as any mesh takes them), loaded once for both engines
            loaded = load_model(directory, "float32", mesh=MeshSpec.parse(ENGINE_MESHES[name][0]))
            one_device = _reference_tokens(ck)
            for text in ENGINE_MESHES[name]:
                results["engine"][f"{name} {text}"] = {"mesh": _engine_tokens(loaded, MeshSpec.parse(text)),
                                                       "one_device": one_device}
                print(name, "engine", text, f"{time.perf_counter() - started:.0f}s", flush=True)
        if name in HLO_MESH:
            results["hlo"][f"{name} {HLO_MESH[name]}"] = _hlo_collectives(ck, MeshSpec.parse(HLO_MESH[name]))
        if name == PROFILE[0]:
            results["profile"] = {"mesh": PROFILE[1], "layers": ck.config.num_layers,
                                  **_profile(directory, PROFILE[1], os.path.join(os.path.dirname(out_json), "profile"))}
            print(name, "profile", f"{time.perf_counter() - started:.0f}s", flush=True)
    with open(out_json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
