"""Trace decode steps (`steps.decode_step`: the engine's two decode dispatches in one program) and
turn the trace into the profile report.

The run: compile `decode_step` once for [batch] rows, warm up, time `steps` steps untraced (the
tok/s), then trace `steps` more with `jax.profiler.trace(out_dir)` (the trace opens in xprof /
TensorBoard's profile plugin). Every step decodes at position `context` into a cache of context + 1
slots, feeding the same positions each time, so each step does the same work (attention over
`context` cached tokens) however many steps run. Every row is active (remaining > 0).

The per-op times of the trace are charged to categories by `gemmax.profile.hlo` from the compiled
module that ran (the executable is the one traced, so op names match), and the roofline uses the
model's own accounting of what a step reads (`gemmax.engine.memory.decode_traffic`).

With `speculative` the verify step is profiled the same way, and a short generation through the
engine gives the accepted-length distribution and the predicted speed-up (gemmax.profile.speculation).
`profile_prefill` profiles one prefill chunk instead, against the compute peak (gemmax.profile.prefill).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.engine.api import SPEC_KS
from gemmax.engine.memory import decode_traffic
from gemmax.engine.policy import DevicePolicy
from gemmax.engine.shapes import kv_buckets
from gemmax.engine.steps import decode_step, init_device_state
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision
from gemmax.model.params import Params, map_params
from gemmax.profile.bandwidth import peak_bandwidth
from gemmax.profile.hlo import CATEGORIES, Classifier, HloIndex
from gemmax.profile.prefill import compute_block, gemm_rates, prefill_executable
from gemmax.profile.report import OTHER, SCHEMA
from gemmax.profile.speculation import (
    VERIFY_BYTES_NOTE,
    acceptance_run,
    predicted_speedup,
    verify_executable,
    verify_traffic,
)
from gemmax.profile.trace import find_xplane, op_times

BYTES_NOTE = (
    "bytes per step from gemmax.engine.memory.decode_traffic: every weight matrix once, the LM head (the "
    "tied embedding table) whole, only the batch's rows of the embedding and PLE tables (gathered, not "
    "streamed), norms, and the K/V each attention layer sees at this context (sliding layers: the window; "
    "KV-sharing layers re-read their donor's)"
)


LAYOUTS = ("auto", "plain")


def load_weights(model: str | None, dtype: str | None = None, random_weights: bool = False,
                 layout: str = "auto", quant=None, mesh=None) -> tuple[Params, ModelConfig, DevicePolicy, str]:
    """(params, config, policy, name) for `gemmax profile`.

    `random_weights`: random weights of the model's config (only its config.json is read; decode time
    does not depend on the values). `layout="plain"`: every matrix [out, in] as in the checkpoint,
    without the device's fast stored form (on CPU, the column blocks that keep wide matrices in the
    fused matrix-vector dot): a path the policy avoids, to see what it costs. `quant`: load-time
    quantisation (a gemmax.quant.QuantOptions), as `gemmax serve` would apply it. `mesh` (a
    gemmax.engine.mesh.MeshSpec): the weights as the mesh path takes them (plain arrays, placed on
    the mesh by `profile_decode`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "plain" and quant is not None:
        quant = quant.for_source(False, dtype_given=True)  # the plain layout is the unquantised one
    if layout == "plain" and quant is not None and quant.changes_weights:
        raise ValueError("--layout plain joins plain matrices: it cannot be combined with quantised weights")
    if random_weights:
        if model is None:
            raise ValueError("--random-weights needs --model (a directory, config.json, .gguf or hub id)")
        from gemmax.engine.fastpath import prepare_params
        from gemmax.engine.loading import resolve_policy
        from gemmax.model.params import random_params
        from gemmax.quant import QuantOptions, quantize_params
        from gemmax.weights.load import open_source

        quant = (quant or QuantOptions()).for_source(False, dtype_given=True)  # random weights: nothing was quantised
        config = open_source(model, weights=False).config
        policy, plan = resolve_policy(dtype, quant, config)
        params = random_params(config, 0, policy.weight_dtype)
        if quant.changes_weights:
            params = quantize_params(params, config, plan.options, plan.kernel)
        if mesh is None:
            params = prepare_params(params, config, policy)
        name = f"{model} (random weights)"
    else:
        from gemmax.engine.loading import load_model

        loaded = load_model(model, dtype, quant, mesh=mesh)
        params, config, policy, name = loaded.checkpoint.params, loaded.checkpoint.config, loaded.policy, loaded.name
    if layout == "plain":
        params = plain_layout(params, config)
    return params, config, policy, name


def plain_layout(params: Params, config: ModelConfig) -> Params:
    """Params with every column-blocked matrix (`fastpath.prepare_params`) joined back into one [out, in]."""
    return map_params(params, config,
                      lambda _, value: jnp.concatenate(value, axis=-1) if isinstance(value, tuple) else value)


def profile_decode(
    params: Params,
    config: ModelConfig,
    policy: DevicePolicy,
    *,
    out_dir: str | Path,
    steps: int = 20,
    warmup: int = 5,
    batch: int = 1,
    context: int = 128,
    precision: Precision | None = None,
    peak_gbs: float | None = None,
    bandwidth_mib: int = 512,
    model: str = "",
    mesh=None,
    speculative=None,
    spec_tokens: int = 64,
) -> dict[str, Any]:
    """Profile `steps` decode steps; writes the trace and `profile.json` under out_dir, returns the report.

    `mesh` (a gemmax.engine.mesh.MeshSpec): the engine's decode step compiled for that mesh
    (`mesh_steps`), the params and state placed as the engine places them. The per-op times are
    then summed over the mesh's devices, and the `collective` category is the communication's share
    of that device time. No roofline on a mesh (what each device reads depends on the axes).

    `speculative` (a gemmax.engine.api.Speculation, method "ngram"): also profile the verify step at
    its k (trace under out_dir/verify) and generate `spec_tokens` tokens through the engine's
    speculative path for the accepted-length distribution (`profile_speculation`); the report's
    `speculative` block (None without)."""
    if steps < 1 or warmup < 0 or batch < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, batch >= 1 (got {steps}, {warmup}, {batch})")
    if not 0 <= context < config.max_position_embeddings:
        raise ValueError(f"context must be in [0, {config.max_position_embeddings}), got {context}")
    if speculative is not None and (mesh is not None or speculative.method != "ngram" or speculative.k not in SPEC_KS):
        raise ValueError(f"--speculative profiles prompt lookup (ngram) at k in {SPEC_KS} on one device (no --mesh), "
                         f"got {speculative}")
    precision = precision or policy.precision()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    device = init_device_state(config, batch, context + 1, precision)
    device = dataclasses.replace(device, tokens=jnp.full(batch, config.bos_token_id, jnp.int32),
                                 positions=jnp.full(batch, context, jnp.int32),
                                 remaining=jnp.full(batch, 1 << 30, jnp.int32))
    want = jnp.zeros(batch, jnp.bool_)
    step, devices = decode_step, 1
    if mesh is not None:
        from gemmax.engine.mesh import check_mesh, make_mesh, mesh_steps, shard_params, state_shardings

        check_mesh(mesh, config, batch)
        device_mesh = make_mesh(mesh)
        step = mesh_steps(device_mesh, config, batch, context + 1, precision).decode_step
        params = shard_params(params, config, device_mesh)
        device = jax.device_put(device, state_shardings(device, device_mesh))
        devices = mesh.size
    compiled = step.lower(params, device, want, config=config, precision=precision).compile()

    def run(n: int) -> None:
        nonlocal device
        for _ in range(n):  # enqueued back to back, as the engine does; positions stay at `context`
            device, _ = compiled(params, device, want)
            device = dataclasses.replace(device, positions=device.positions - 1)
        jax.block_until_ready(device.tokens)

    host_step, times, xplane, report = _measure(compiled, run, steps, warmup, out_dir)
    traffic = decode_traffic(config, params, batch, context, precision.kv_cache)
    peak = None if mesh is not None else peak_bandwidth(policy.device_kind, policy.platform, peak_gbs,
                                                        times.memory_bandwidth, bandwidth_mib)
    achieved = None if mesh is not None else traffic.total / host_step / 1e9
    report.update({
        **_identity(params, policy, precision, model),
        "step": "decode",
        "batch": batch, "context": context, "steps": steps, "warmup": warmup,
        "mesh": None if mesh is None else str(mesh), "devices": devices,
        "traced_steps_seen": times.steps,
        "device_ms_per_step": times.total_ns / 1e6,
        "trace_step_ms": times.step_span_ns / 1e6,
        "host_step_ms": host_step * 1e3,
        "tokens_per_second": batch / host_step,
        "bytes_per_step": {"matrices": traffic.matrices, "lm_head": traffic.lm_head, "gathered": traffic.gathered,
                           "norms": traffic.norms, "kv": traffic.kv, "total": traffic.total},
        "bytes_note": BYTES_NOTE,
        "peak_bandwidth_gbs": peak.gbs if peak else None,
        "peak_bandwidth_source": (peak.source if peak else "not computed on a mesh" if mesh is not None
                                  else "unknown device: give --peak-bandwidth"),
        "achieved_gbs": achieved,
        "roofline_tokens_per_second": batch * peak.gbs * 1e9 / traffic.total if peak else None,
        "roofline_percent": 100 * achieved / peak.gbs if peak and achieved else None,
        **_tensor_core(report, policy),
        "trace_dir": str(out_dir),
        "xplane": str(xplane),
        "trace_source": times.source,
    })
    report["speculative"] = None
    if speculative is not None:
        report["speculative"] = profile_speculation(
            params, config, policy, out_dir=out_dir / "verify", steps=steps, warmup=warmup, batch=batch,
            context=context, k=speculative.k, precision=precision, peak=peak, decode_step_ms=host_step * 1e3,
            tokens=spec_tokens, model=model)
    (out_dir / "profile.json").write_text(json.dumps(report, indent=1))
    return report


def _identity(params: Params, policy: DevicePolicy, precision: Precision, model: str) -> dict[str, Any]:
    """What every report starts with: schema, model, device, policy and the dtypes as they really are."""
    weights = sorted({jnp.dtype(leaf.dtype).name for leaf in jax.tree.leaves(params) if leaf.ndim >= 2})
    return {
        "schema": SCHEMA,
        "model": model,
        "device": {"platform": policy.platform, "kind": policy.device_kind},
        "policy": policy.as_dict(),
        "precision": {"weights": "+".join(weights), "activations": jnp.dtype(precision.activation).name,
                      "kv_cache": jnp.dtype(precision.kv_cache).name},
    }


def _tensor_core(summary: dict[str, Any], policy: DevicePolicy) -> dict[str, Any]:
    """The 16-bit matmul share where a device has tensor cores / an MXU to run it."""
    if policy.platform in ("gpu", "tpu"):
        return {"tensor_core_percent": summary["categories"]["matmul_lowp"]["percent"],
                "tensor_core_note": "16-bit / int8 matmul time (tensor-core / MXU eligible), from the HLO"}
    return {"tensor_core_percent": None, "tensor_core_note": "not reported on CPU (no tensor cores / MXU)"}


def profile_prefill(params: Params, config: ModelConfig, policy: DevicePolicy, *, out_dir: str | Path,
                    tokens: int, context: int = 0, steps: int = 10, warmup: int = 2,
                    precision: Precision | None = None, model: str = "") -> dict[str, Any]:
    """Profile one prefill chunk of `tokens` tokens after `context` cached ones (gemmax.profile.prefill);
    writes the trace and `profile.json` under out_dir, returns the report."""
    if steps < 1 or warmup < 0 or tokens < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, tokens >= 1 (got {steps}, {warmup}, {tokens})")
    if context < 0 or context + tokens > config.max_position_embeddings:
        raise ValueError(f"context + tokens must be at most {config.max_position_embeddings}, got {context} + {tokens}")
    precision = precision or policy.precision()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The engine's KV bounds for a cache of exactly context + tokens: at context 0 the chunk reads no
    # past, as a prompt's first chunk does; past it, the first bound that holds the context (at most
    # the one an engine with a longer max_model_len reads).
    bounds = kv_buckets(context + tokens)
    compiled, run, flops = prefill_executable(params, config, tokens, context, precision, bounds)
    host_step, times, xplane, report = _measure(compiled, run, steps, warmup, out_dir)
    rates = gemm_rates(config, tokens, jnp.dtype(policy.compute_dtype))
    report.update({
        **_identity(params, policy, precision, model),
        "step": "prefill",
        "batch": 1, "context": context, "kv_bounds": list(bounds), "steps": steps, "warmup": warmup,
        "traced_steps_seen": times.steps,
        "device_ms_per_step": times.total_ns / 1e6,
        "trace_step_ms": times.step_span_ns / 1e6,
        "host_step_ms": host_step * 1e3,
        "prefill": compute_block(flops, host_step, tokens, rates),
        **_tensor_core(report, policy),
        "trace_dir": str(out_dir),
        "xplane": str(xplane),
        "trace_source": times.source,
        "speculative": None,
    })
    (out_dir / "profile.json").write_text(json.dumps(report, indent=1))
    return report


def _measure(compiled, run, steps: int, warmup: int, out_dir: Path):
    """Warm up, time `steps` runs untraced (host clock), trace `steps` more under out_dir; returns
    (seconds per step, the trace's op times, its xplane file, the summary by category)."""
    index = HloIndex.from_compiled(compiled)
    run(max(warmup, 1))
    started = time.perf_counter()
    run(steps)
    host_step = (time.perf_counter() - started) / steps
    with jax.profiler.trace(str(out_dir)):
        run(steps)
    xplane = find_xplane(out_dir)
    times = op_times(xplane, index.name, steps)
    return host_step, times, xplane, summarize(times.per_op_ns, Classifier(index))


def profile_speculation(params: Params, config: ModelConfig, policy: DevicePolicy, *, out_dir: Path, steps: int,
                        warmup: int, batch: int, context: int, k: int, precision: Precision, peak,
                        decode_step_ms: float, tokens: int, model: str) -> dict[str, Any]:
    """The `speculative` block of the report (gemmax.profile.speculation): the verify step of [batch]
    rows with k proposals at `context`, profiled as the decode step is (its trace under out_dir), the
    accepted-length distribution of a short generation through the engine, and the predicted speed-up."""
    compiled, run = verify_executable(params, config, batch, context, k, precision)
    host_step, times, xplane, verify = _measure(compiled, run, steps, warmup, out_dir)
    traffic = verify_traffic(config, params, batch, context, k, precision.kv_cache)
    achieved = traffic["total"] / host_step / 1e9
    verify.update({
        "device_ms_per_step": times.total_ns / 1e6,
        "trace_step_ms": times.step_span_ns / 1e6,
        "host_step_ms": host_step * 1e3,
        "traced_steps_seen": times.steps,
        "positions_per_row": k + 1,
        "bytes_per_step": traffic,
        "bytes_note": VERIFY_BYTES_NOTE,
        "achieved_gbs": achieved,
        "roofline_percent": 100 * achieved / peak.gbs if peak else None,
        "trace_dir": str(out_dir),
        "xplane": str(xplane),
    })
    accepted = acceptance_run(params, config, policy, model, k, tokens)
    return {
        "method": "ngram",
        "k": k,
        "verify": verify,
        **accepted,
        "decode_step_ms": decode_step_ms,
        "verify_step_ms": host_step * 1e3,
        "predicted_speedup": predicted_speedup(accepted["tokens_per_verify_step"], decode_step_ms, host_step * 1e3),
    }


def summarize(per_op_ns: dict[str, float], classifier: Classifier, top: int = 25) -> dict[str, Any]:
    """Per-op ns per step -> categories, the four headline shares (summing to 100%) and the top ops."""
    total = sum(per_op_ns.values())
    if total <= 0:
        raise ValueError("the trace holds no op time")
    by_cat: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    fused_convert = 0.0
    ops = []
    unknown = sorted(set(per_op_ns) - set(classifier.index.instrs))
    if unknown:
        raise ValueError(f"traced ops missing from module {classifier.index.name}: {unknown[:5]}")
    for name, ns in per_op_ns.items():
        info = classifier.classify(name)
        by_cat[info.category] += ns
        count[info.category] += 1
        fused_convert += ns if info.fused_convert else 0.0
        ops.append({"name": name, "category": info.category, "ms_per_step": ns / 1e6, "percent": 100 * ns / total,
                    "opcodes": list(info.opcodes), "read_dtype": info.read_dtype, "op_name": info.op_name})
    categories = {c: {"ms_per_step": by_cat[c] / 1e6, "percent": 100 * by_cat[c] / total, "ops": count[c]}
                  for c in CATEGORIES}
    shares = {c: categories[c]["percent"] for c in ("conversion", "matmul_fp32", "matmul_lowp")}
    shares["other"] = sum(categories[c]["percent"] for c in OTHER)
    ops.sort(key=lambda op: -op["ms_per_step"])
    return {"shares": shares, "categories": categories, "fused_convert_percent": 100 * fused_convert / total,
            "top_ops": ops[:top]}
