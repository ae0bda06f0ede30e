"""One check of gemmax on the device it runs on: a table and one JSON line, in under 8 minutes on one GPU.

Sections (each runs on its own: one that fails is recorded with its error and the others still run;
the JSON file is rewritten after every section, so a run cut short keeps what it measured):

- policy:     the device policy line, jax / jaxlib / Python versions, and the W4A16 plan gemmax would
              pick for the E2B config on this device (Pallas only after its start-up probe passed).
- parity:     float32 logits of a tiny random Gemma 4 (tests/hf_reference.py, every feature on) run on
              the device against transformers (the reference implementation) on the host, at JAX's
              default matmul precision and at "highest" (the pass/fail one: on GPUs the default may
              use TF32 for float32 products).
- serve:      the real server (BatchEngine + app + uvicorn on loopback) over a tiny random checkpoint in
              the policy's dtype: /health's policy and precision, and one chat completion.
- bandwidth:  the device's memory bandwidth measured now (a read-only reduction and a read+write
              pass over a buffer far beyond the caches; on CPU the all-core read of
              gemmax.engine.memory.measure_read_bandwidth as well).
- decode:     E2B-shaped random model (6 layers, benchmarks/decode.py) decode tok/s at batch 1 and 8 in
              the policy's dtype and in the wrong one (float16 on SM >= 8.0, TPU and CPU; bfloat16
              below SM 8.0), with bytes per step and the share of the bandwidth roofline.
- profile:    gemmax.profile's trace of one decode step in both dtypes: dtype-conversion share (and the
              other headline shares).
- w4a16:      the W4A16 Pallas kernel compiled for real (interpret=False; interpret mode on CPU) on the
              model's matrix shapes: max error against the XLA dequantise path and the speed of both.
- quant:      decode tok/s of the same model with int8 weights, and W4A16 through the XLA path and
              through the Pallas kernel.

`--reduced` (the default on CPU) runs every section on a small model, so CI runs the whole script
(tests/test_device_check.py). On a machine without network see docs/gpu.md for the wheels to bring.

    python benchmarks/device_check.py [--out DIR] [--reduced | --full] [--sections a,b] [--budget-s 450]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform as host_platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT / "tests", ROOT / "benchmarks"):  # hf_reference, tiny_checkpoint; decode.py
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

SCHEMA = "gemmax.device_check/1"
SECTIONS = ("policy", "parity", "w4a16", "bandwidth", "decode", "quant", "profile", "serve")
PARITY_TOL = 1e-4  # float32 logits, as tests/test_model_parity.py
W4A16_TOL = 2e-2  # relative to max |y|: both paths use bf16 weight tiles and float32 accumulation

# The small model of --reduced: E2B's structure (KV sharing, PLE, double-wide MLP, sliding + full) at toy sizes.
REDUCED_OVERRIDES = {
    "vocab_size": 2048, "vocab_size_per_layer_input": 2048, "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 2, "head_dim": 64, "global_head_dim": 128, "hidden_size_per_layer_input": 32,
    "sliding_window": 64, "max_position_embeddings": 4096,
}


# ------------------------------------------------------------------------------------------- helpers


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() (which must block) over `repeats` calls after one warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def model_config(reduced: bool):
    from gemmax.model.config import E2B_SIX_LAYER_CONFIG, ModelConfig

    hf = dict(E2B_SIX_LAYER_CONFIG, **(REDUCED_OVERRIDES if reduced else {}))
    return ModelConfig.from_hf_config(hf)


def wrong_dtype(policy) -> str:
    """The dtype the policy avoids on this device: bf16 below SM 8.0, float16 elsewhere."""
    return "bfloat16" if policy.pre_ampere else "float16"


def policy_for(dtype: str):
    from gemmax.engine.policy import device_policy

    return device_policy(None if dtype == "auto" else dtype)


def build_params(ctx, dtype: str, quant=None):
    """(params, policy) of the benchmark model in `dtype` (random weights), quantised as `quant`
    (a QuantOptions) asks and put in the device's stored form."""
    from gemmax.engine.fastpath import prepare_params
    from gemmax.model.params import random_params
    from gemmax.quant import quantize_params
    from gemmax.quant import resolve as resolve_quant

    policy = policy_for(dtype)
    params = random_params(ctx.config, 0, policy.weight_dtype)
    if quant is not None:
        plan = resolve_quant(quant, policy.platform, policy.compute_capability, ctx.config)
        params = quantize_params(params, ctx.config, plan.options, plan.kernel)
        policy = dataclasses.replace(policy, quant=plan.options)
    return prepare_params(params, ctx.config, policy), policy


def decode_rates(ctx, params, policy, label: str) -> dict[str, Any]:
    """tok/s at batch 1 and 8 for one stored form, with bytes per step and the roofline share."""
    from decode import gemmax_step_runner, time_steps
    from gemmax.engine.memory import decode_traffic

    loaded = SimpleNamespace(checkpoint=SimpleNamespace(params=params, config=ctx.config), policy=policy)
    out = {}
    for batch in (1, 8):
        seconds = time_steps(gemmax_step_runner(loaded, batch, ctx.context), ctx.steps, ctx.repeats)
        traffic = decode_traffic(ctx.config, params, batch, ctx.context, policy.precision().kv_cache)
        achieved = traffic.total / seconds / 1e9
        row = {"tok_s": batch / seconds, "step_ms": seconds * 1e3, "bytes_per_step": traffic.total,
               "achieved_gb_s": achieved}
        if ctx.bandwidth_gb_s:
            row["roofline_share"] = achieved / ctx.bandwidth_gb_s
        out[f"b{batch}"] = row
        ctx.progress(f"{label} b{batch}: {row['tok_s']:.1f} tok/s ({row['step_ms']:.2f} ms/step)")
    return out


# ------------------------------------------------------------------------------------------- sections


def section_policy(ctx) -> dict[str, Any]:
    import jax
    import jaxlib

    from gemmax.engine.kernel_probe import live_probe
    from gemmax.quant import QuantOptions
    from gemmax.quant import resolve as resolve_quant

    policy = policy_for("auto")
    plan = resolve_quant(QuantOptions(quant="w4a16"), policy.platform, policy.compute_capability, ctx.config,
                         probe=live_probe(policy.platform))
    return {
        "line": policy.log_line(),
        "warning": policy.warning,
        "platform": policy.platform, "device_kind": policy.device_kind,
        "compute_capability": policy.compute_capability, "compute_dtype": policy.compute_dtype,
        "device_memory_bytes": policy.device_memory_bytes,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": host_platform.python_version(),
        "devices": [str(d) for d in jax.devices()],
        "w4a16_plan": {"kernel": plan.options.w4a16_kernel, "tiles": str(plan.options.w4a16_tiles),
                       "probe": getattr(plan.options, "w4a16_probe", None), "note": plan.note},
    }


def section_parity(ctx) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from gemmax.model.forward import forward_jit
    from gemmax.model.kv_cache import init_cache
    from gemmax.weights.load import load_checkpoint
    from hf_reference import build_gemma4

    out: dict[str, Any] = {"tolerance": PARITY_TOL, "device": str(jax.devices()[0]), "reference": "transformers (host CPU)"}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_gemma4("g4_shared", Path(tmp))
        ck = load_checkpoint(tmp, weight_dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, ck.config.vocab_size, (2, 3 * ck.config.sliding_window + 2))
    with torch.no_grad():
        reference = model(torch.tensor(ids)).logits.float().numpy()
    b, t = ids.shape
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(None if precision == "default" else precision):
            logits, _ = forward_jit(ck.params, init_cache(ck.config, b, 96), jnp.asarray(ids, jnp.int32),
                                    jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32), config=ck.config, logits="all")
        out[f"max_abs_diff_{precision}"] = float(np.abs(np.asarray(logits) - reference).max())
    out["passed"] = out["max_abs_diff_highest"] <= PARITY_TOL
    if not out["passed"]:
        raise CheckFailed(f"float32 logits differ by {out['max_abs_diff_highest']:.2e} > {PARITY_TOL}", out)
    return out


def section_serve(ctx) -> dict[str, Any]:
    import httpx
    import uvicorn

    from gemmax.engine.engine import BatchEngine
    from gemmax.engine.loading import load_model
    from gemmax.server.app import ServerSettings, create_app
    from tiny_checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        directory = write_tiny_checkpoint(Path(tmp) / "ckpt")
        loaded = load_model(str(directory))  # the policy's dtype
        engine = BatchEngine(loaded, max_model_len=256, max_batch=2, buckets=(32,)).start()
        app = create_app(engine, loaded.tokenizer, ServerSettings(served_model_name="tiny", model_root=str(directory)))
        # A Unix socket, not loopback TCP: some accelerator machines (the TPU machines this was run
        # on) refuse every TCP socket, loopback included; the HTTP is the same.
        socket_path = str(Path(tmp) / "server.sock")
        server = uvicorn.Server(uvicorn.Config(app, uds=socket_path, log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        # Host: localhost, a loopback name (on a loopback bind the server refuses other Host headers)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://localhost")
        try:
            if not engine.wait_ready(300):
                raise RuntimeError("the engine did not become ready in 300 s")
            deadline = time.time() + 60
            while True:
                try:
                    health = client.get("/health", timeout=10)
                    if health.status_code == 200 or time.time() > deadline:
                        break
                except httpx.TransportError:
                    if time.time() > deadline:
                        raise
                time.sleep(0.1)
            body = health.json()
            t0 = time.perf_counter()
            reply = client.post("/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0})
            seconds = time.perf_counter() - t0
            answer = reply.json()
        finally:
            server.should_exit = True
            thread.join(30)
            client.close()
            engine.shutdown(5)
    out = {"health_status": health.status_code, "policy_platform": body.get("policy", {}).get("platform"),
           "policy_compute_dtype": body.get("policy", {}).get("compute_dtype"), "precision": body.get("precision"),
           "chat_status": reply.status_code, "chat_seconds": seconds,
           "completion_tokens": (answer.get("usage") or {}).get("completion_tokens"),
           "finish_reason": (answer.get("choices") or [{}])[0].get("finish_reason")}
    if health.status_code != 200 or reply.status_code != 200 or not out["completion_tokens"]:
        raise CheckFailed("the served request did not succeed", out)
    return out


def section_bandwidth(ctx) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    mib = 64 if ctx.reduced else 4096
    x = jnp.ones((mib << 18,), jnp.float32)  # mib MiB of float32
    nbytes = x.size * 4
    total = jax.jit(lambda a: jnp.sum(a))
    scale = jax.jit(lambda a: a * 1.0001 + 1.0)
    read_s = timed(lambda x=x: jax.block_until_ready(total(x)), ctx.repeats + 4)
    copy_s = timed(lambda x=x: jax.block_until_ready(scale(x)), ctx.repeats + 4)
    out = {"buffer_mib": mib, "read_gb_s": nbytes / read_s / 1e9, "read_write_gb_s": 2 * nbytes / copy_s / 1e9}
    if ctx.platform == "cpu":
        from gemmax.engine.memory import measure_read_bandwidth

        out["cpu_all_core_read_gb_s"] = measure_read_bandwidth(size_mib=mib * 4, repeats=5)
    # The roofline uses the best read figure measured in this run (a spec sheet says only what could be).
    out["roofline_gb_s"] = max(v for k, v in out.items() if k.endswith("gb_s"))
    from gemmax.profile.bandwidth import spec_bandwidth

    spec = spec_bandwidth(policy_for("auto").device_kind)
    if spec is not None:
        out["spec_gb_s"], out["measured_over_spec"] = spec.gbs, out["roofline_gb_s"] / spec.gbs
    ctx.bandwidth_gb_s = out["roofline_gb_s"]
    return out


def section_decode(ctx) -> dict[str, Any]:
    ctx.need_bandwidth()
    policy = policy_for("auto")
    out = {"model": ctx.model_name, "context": ctx.context, "steps": ctx.steps, "repeats": ctx.repeats,
           "bandwidth_gb_s": ctx.bandwidth_gb_s}
    for role, dtype in (("policy", policy.compute_dtype), ("wrong", wrong_dtype(policy))):
        params, p = build_params(ctx, dtype)
        out[role] = {"dtype": dtype, "override_warning": p.warning, **decode_rates(ctx, params, p, f"decode {dtype}")}
        del params
    out["policy_over_wrong_b1"] = out["policy"]["b1"]["tok_s"] / out["wrong"]["b1"]["tok_s"]
    out["policy_over_wrong_b8"] = out["policy"]["b8"]["tok_s"] / out["wrong"]["b8"]["tok_s"]
    return out


COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def section_profile(ctx) -> dict[str, Any]:
    from gemmax.profile.run import profile_decode

    wanted = ctx.profile_subprocess == "yes" or (ctx.profile_subprocess == "auto" and ctx.platform == "gpu")
    if wanted and COMMAND_BUFFERS_OFF not in os.environ.get("XLA_FLAGS", ""):
        return profile_in_subprocess(ctx)
    ctx.need_bandwidth()
    policy = policy_for("auto")
    out = {}
    for role, dtype in (("policy", policy.compute_dtype), ("wrong", wrong_dtype(policy))):
        params, p = build_params(ctx, dtype)
        with tempfile.TemporaryDirectory() as tmp:
            report = profile_decode(params, ctx.config, p, out_dir=tmp, steps=max(4, ctx.steps // 2), warmup=2,
                                    batch=1, context=ctx.context, peak_gbs=ctx.bandwidth_gb_s, model=ctx.model_name)
        out[role] = {"dtype": dtype, "conversion_percent": report["shares"]["conversion"],
                     "fused_convert_percent": report["fused_convert_percent"],
                     "matmul_lowp_percent": report["shares"]["matmul_lowp"],
                     "matmul_fp32_percent": report["shares"]["matmul_fp32"],
                     "device_ms_per_step": report["device_ms_per_step"], "host_step_ms": report["host_step_ms"],
                     "roofline_percent": report["roofline_percent"], "trace_source": report["trace_source"],
                     "top_ops": [(op["name"], op["category"], round(op["percent"], 1)) for op in report["top_ops"][:5]]}
        ctx.progress(f"profile {dtype}: conversion {out[role]['conversion_percent']:.1f}%")
        del params
    return out


def profile_in_subprocess(ctx) -> dict[str, Any]:
    """XLA:GPU runs a step's kernels as CUDA command buffers (graphs) whose trace events carry no HLO op
    names, so the profiler cannot charge their time to ops: the profile runs in a child process with
    command buffers off (the decode numbers of the other sections keep them on)."""
    import subprocess

    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFERS_OFF}".strip())
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, str(Path(__file__).resolve()), "--sections", "profile", "--out", tmp,
                "--full" if not ctx.reduced else "--reduced", "--context", str(ctx.context), "--steps", str(ctx.steps),
                "--repeats", str(ctx.repeats)]
        if ctx.bandwidth_gb_s:
            argv += ["--bandwidth-gb-s", str(ctx.bandwidth_gb_s)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        path = Path(tmp) / "device_check.json"
        if not path.is_file():
            raise RuntimeError(f"the profile subprocess wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}")
        entry = json.loads(path.read_text())["sections"]["profile"]
    if entry["status"] != "ok":
        raise CheckFailed(f"profile subprocess: {entry.get('error')}", entry.get("result") or {})
    return {**entry["result"], "xla_flags": env["XLA_FLAGS"]}


def section_w4a16(ctx) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from gemmax.model.linear import linear as qlinear
    from gemmax.quant import QuantOptions, quantize_int4
    from gemmax.quant import resolve as resolve_quant

    policy = policy_for("auto")
    interpret = policy.platform == "cpu"
    plan = resolve_quant(QuantOptions(quant="w4a16", w4a16_kernel="pallas", allow_pallas_interpret=interpret),
                         policy.platform, policy.compute_capability, ctx.config)
    tiles = plan.options.w4a16_tiles
    # The distinct whole-matrix shapes of the model (N, K): gate/up, down, the wide consumers, attention.
    from gemmax.model.params import param_specs

    shapes = sorted({tuple(s.shape) for s in param_specs(ctx.config) if s.kind == "matrix"},
                    key=lambda s: -s[0] * s[1])[: (2 if ctx.reduced else 4)]
    out: dict[str, Any] = {"interpret": interpret, "tiles": str(tiles), "tolerance": W4A16_TOL, "shapes": {}}
    key = jax.random.key(0)
    worst = 0.0
    for n, k in shapes:
        w = jax.random.normal(jax.random.fold_in(key, n * 7 + k), (n, k), jnp.bfloat16) * (k ** -0.5)
        q_xla = quantize_int4(w, "xla")
        q_pallas = dataclasses.replace(q_xla, kernel="pallas_interpret" if interpret else "pallas", tiles=tiles)
        fn = jax.jit(qlinear)
        row: dict[str, Any] = {}
        for m in (1, 8):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            ref = fn(x, q_xla).astype(jnp.float32)
            got = fn(x, q_pallas).astype(jnp.float32)
            err = float(jnp.abs(got - ref).max() / jnp.abs(ref).max())
            worst = max(worst, err)
            reps = 2 if interpret else ctx.repeats * 10
            xla_s = timed(lambda x=x, f=fn, q=q_xla: jax.block_until_ready(f(x, q)), reps)
            pallas_s = timed(lambda x=x, f=fn, q=q_pallas: jax.block_until_ready(f(x, q)), reps)
            weight_bytes = q_xla.packed.nbytes + q_xla.scales.nbytes
            row[f"m{m}"] = {"rel_err": err, "xla_us": xla_s * 1e6, "pallas_us": pallas_s * 1e6,
                            "pallas_over_xla": xla_s / pallas_s, "pallas_weight_gb_s": weight_bytes / pallas_s / 1e9,
                            "xla_weight_gb_s": weight_bytes / xla_s / 1e9}
            ctx.progress(f"w4a16 {n}x{k} m{m}: err {err:.1e}, pallas {pallas_s * 1e6:.0f} us, xla {xla_s * 1e6:.0f} us")
        out["shapes"][f"{n}x{k}"] = row
    out["max_rel_err"] = worst
    out["passed"] = worst <= W4A16_TOL
    if not out["passed"]:
        raise CheckFailed(f"Pallas W4A16 differs from the XLA path by {worst:.2e} of max |y| > {W4A16_TOL}", out)
    return out


def section_quant(ctx) -> dict[str, Any]:
    from gemmax.quant import QuantOptions

    ctx.need_bandwidth()
    policy = policy_for("auto")
    interpret = policy.platform == "cpu"
    variants = {
        "int8": QuantOptions(quant="int8"),
        "w4a16_xla": QuantOptions(quant="w4a16", w4a16_kernel="xla"),
        "w4a16_pallas": QuantOptions(quant="w4a16", w4a16_kernel="pallas", allow_pallas_interpret=interpret),
    }
    out: dict[str, Any] = {"dtype": policy.compute_dtype, "context": ctx.context}
    for name, options in variants.items():
        try:
            params, p = build_params(ctx, "auto", options)
            out[name] = {"kernel": p.quant.w4a16_kernel if options.quant == "w4a16" else "int8",
                         **decode_rates(ctx, params, p, f"decode {name}")}
            del params
        except Exception as exc:  # one variant failing keeps the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            ctx.progress(f"decode {name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    failed = [k for k in variants if "error" in out[k]]
    if failed:
        raise CheckFailed(f"quantised decode failed for {', '.join(failed)}", out)
    return out


class CheckFailed(Exception):
    """A section that ran but whose check failed: carries what it measured."""

    def __init__(self, message: str, result: dict[str, Any]):
        super().__init__(message)
        self.result = result


RUNNERS = {"policy": section_policy, "parity": section_parity, "serve": section_serve,
           "bandwidth": section_bandwidth, "decode": section_decode, "profile": section_profile,
           "w4a16": section_w4a16, "quant": section_quant}


# ------------------------------------------------------------------------------------------- report


def _f(x: Any, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if not isinstance(x, int | float) else f"{x:{spec}}{unit}"


def table_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(section, what, value) rows from the report alone."""
    rows: list[tuple[str, str, str]] = []
    for name, s in report["sections"].items():
        r = s.get("result") or {}
        if s["status"] != "ok":
            rows.append((name, "status", f"{s['status'].upper()}: {s.get('error', '')[:200]}"))
        if name == "policy" and r:
            rows += [(name, "line", r["line"]), (name, "jax / jaxlib / python", f"{r['jax']} / {r['jaxlib']} / {r['python']}"),
                     (name, "W4A16 kernel (probe)", f"{r['w4a16_plan']['kernel']} ({r['w4a16_plan']['probe']})")]
        elif name == "parity" and r:
            rows += [(name, "max |logit diff| default / highest",
                      f"{_f(r.get('max_abs_diff_default'), '.1e')} / {_f(r.get('max_abs_diff_highest'), '.1e')} (tol {PARITY_TOL:.0e})")]
        elif name == "serve" and r:
            rows += [(name, "/health precision", json.dumps(r.get("precision"))),
                     (name, "chat completion", f"HTTP {r.get('chat_status')}, {r.get('completion_tokens')} tokens, "
                                                f"{_f(r.get('chat_seconds'), '.2f', ' s')}")]
        elif name == "bandwidth" and r:
            rows += [(name, "read / read+write GB/s", f"{_f(r['read_gb_s'])} / {_f(r['read_write_gb_s'])}"),
                     (name, "roofline GB/s (of spec)", f"{_f(r['roofline_gb_s'])} ({_f(100 * r.get('measured_over_spec', float('nan')), '.0f', '%')})"
                      if "spec_gb_s" in r else _f(r["roofline_gb_s"]))]
        elif name in ("decode", "quant") and r:
            for role, v in r.items():
                if isinstance(v, dict) and "b1" in v:
                    label = f"{role} {v.get('dtype', v.get('kernel', ''))}".strip()
                    for b in ("b1", "b8"):
                        share = v[b].get("roofline_share")
                        rows.append((name, f"{label} {b} tok/s (roofline)",
                                     f"{_f(v[b]['tok_s'])} ({_f(None if share is None else 100 * share, '.0f', '%')})"))
                elif isinstance(v, dict) and "error" in v:
                    rows.append((name, role, f"FAILED: {v['error'][:200]}"))
        elif name == "profile" and r:
            for role, v in r.items():
                if not isinstance(v, dict):
                    continue
                rows.append((name, f"{role} {v['dtype']} conversion / fused convert",
                             f"{_f(v['conversion_percent'], '.1f', '%')} / {_f(v['fused_convert_percent'], '.1f', '%')}"))
        elif name == "w4a16" and r:
            for shape, v in r.get("shapes", {}).items():
                for m, x in v.items():
                    rows.append((name, f"{shape} {m} err / pallas vs xla",
                                 f"{x['rel_err']:.1e} / {x['pallas_us']:.0f} us vs {x['xla_us']:.0f} us"))
        rows.append((name, "seconds", _f(s.get("seconds"))))
    return rows


def render(report: dict[str, Any]) -> str:
    head = (f"gemmax device check ({'reduced' if report['reduced'] else 'full'}) on "
            f"{report.get('device', '?')}, {report['elapsed_s']:.0f} s")
    lines = [head, "", "| section | what | value |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c.replace('|', '/')} |" for a, b, c in table_rows(report)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main


class Context:
    def __init__(self, args, out: Path | None):
        import jax

        self.reduced = args.reduced if args.reduced is not None else jax.default_backend() == "cpu"
        self.platform = jax.default_backend()
        self.config = model_config(self.reduced)
        self.model_name = "E2B-shaped 6 layers" + (" (reduced sizes)" if self.reduced else "")
        self.context = args.context or (64 if self.reduced else 128)
        self.steps = args.steps or (4 if self.reduced else 32)
        self.repeats = args.repeats or (2 if self.reduced else 3)
        self.bandwidth_gb_s: float | None = args.bandwidth_gb_s
        self.profile_subprocess = args.profile_subprocess
        self.out = out

    def need_bandwidth(self) -> None:
        if self.bandwidth_gb_s is None:
            section_bandwidth(self)

    def progress(self, message: str) -> None:
        print(f"  {message}", flush=True)


def write(out: Path | None, report: dict[str, Any]) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "device_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out / "device_check.json")
    (out / "device_check.md").write_text(render(report) + "\n")


def run(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for device_check.json / .md (rewritten after each section)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--reduced", dest="reduced", action="store_true", default=None, help="small model (CPU default)")
    size.add_argument("--full", dest="reduced", action="store_false", help="E2B-shaped model even on CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--budget-s", type=float, default=450.0, help="sections not started by then are skipped")
    parser.add_argument("--context", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--profile-subprocess", choices=("auto", "yes", "no"), default="auto",
                        help="profile in a child process with XLA:GPU command buffers off (auto: on GPU)")
    parser.add_argument("--bandwidth-gb-s", type=float, help="use this bandwidth instead of measuring it")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")

    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    ctx = Context(args, args.out)
    import jax

    from gemmax.engine.executables import code_hash

    # `code`: the hash of gemmax's numeric source that ran (a copied tree may carry no git history)
    report: dict[str, Any] = {"schema": SCHEMA, "reduced": ctx.reduced, "platform": ctx.platform,
                              "code": code_hash()[:12], "device": str(jax.devices()[0].device_kind), "model": ctx.model_name,
                              "argv": sys.argv[1:] if argv is None else argv, "sections": {}, "elapsed_s": 0.0}
    for name in chosen:
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            report["sections"][name] = {"status": "skipped", "error": f"time budget {args.budget_s:.0f} s spent"}
            continue
        print(f"[{elapsed:6.1f} s] {name} ...", flush=True)
        t0 = time.perf_counter()
        entry: dict[str, Any]
        try:
            entry = {"status": "ok", "result": RUNNERS[name](ctx)}
        except CheckFailed as exc:
            entry = {"status": "failed", "error": str(exc), "result": exc.result}
        except Exception as exc:
            entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
                     "traceback": traceback.format_exc()[-4000:]}
            print(entry["traceback"], file=sys.stderr, flush=True)
        entry["seconds"] = time.perf_counter() - t0
        report["sections"][name] = entry
        report["elapsed_s"] = time.perf_counter() - started
        print(f"[{report['elapsed_s']:6.1f} s] {name}: {entry['status']}", flush=True)
        write(args.out, report)
    report["elapsed_s"] = time.perf_counter() - started
    report["ok"] = all(s["status"] == "ok" for s in report["sections"].values())
    write(args.out, report)
    print(render(report))
    print(json.dumps(report, default=str))
    return report


def main() -> None:
    report = run()
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
