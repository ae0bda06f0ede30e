"""`gemmax profile`: op classification from the compiled HLO, per-op times from a real JAX profiler
trace, shares that add up, and the bytes-per-step accounting of the roofline.

The checkpoint is a tiny random Gemma 4 built by transformers (the g4_shared recipe) with a wide MLP:
its down projections read 4160 / 8320 inputs, more than the 4095 XLA:CPU's fused matrix-vector dot
takes. The policy's stored form splits them into column blocks; `--layout plain` keeps them whole,
the path the policy avoids, and XLA then converts each of them to an f32 copy on every step.

`--speculative ngram` runs on the same checkpoint: the verify step profiled like the decode step, and
the accepted-length distribution of a short greedy generation through the engine's speculative path.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from gemmax.cli import app
from gemmax.model.config import ModelConfig
from gemmax.model.linear import linear, lookup
from gemmax.model.params import param_specs
from gemmax.profile import load
from gemmax.profile.bandwidth import peak_bandwidth, spec_bandwidth
from gemmax.profile.hlo import Classifier, HloIndex
from gemmax.profile.run import load_weights, profile_decode
from gemmax.profile.trace import _exclusive, _ops_in_module_spans, op_times
from hf_reference import GEMMA4_CONFIGS, randomize_norms

WIDE = {**GEMMA4_CONFIGS["g4_shared"], "intermediate_size": 4160}  # double-wide (KV-shared) layers: 8320


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    directory = tmp_path_factory.mktemp("profile") / "g4_wide"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**WIDE, attn_implementation="eager")).eval()
    randomize_norms(model, 0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def two_runs(wide_checkpoint, tmp_path_factory):
    """The CLI run twice on the same checkpoint: the policy's layout, then the plain one."""
    out = tmp_path_factory.mktemp("runs")
    runner = CliRunner()
    common = ["profile", "--model", str(wide_checkpoint), "--steps", "8", "--warmup", "2", "--context", "16"]
    results = {}
    for layout, extra in (("auto", []), ("plain", ["--peak-bandwidth", "30"])):
        result = runner.invoke(app, [*common, "--layout", layout, "--out", str(out / layout), *extra])
        assert result.exit_code == 0, result.output
        results[layout] = (result.stdout, load(out / layout / "profile.json"))
    return out, results


def _shares_add_up(report):
    assert sum(report["shares"].values()) == pytest.approx(100, abs=1)
    assert sum(c["percent"] for c in report["categories"].values()) == pytest.approx(100, abs=1)
    assert sum(c["ms_per_step"] for c in report["categories"].values()) == pytest.approx(report["device_ms_per_step"])


def test_forced_plain_layout_shows_its_conversion_time(two_runs):
    _, results = two_runs
    (stdout, auto), (_, plain) = results["auto"], results["plain"]
    _shares_add_up(auto)
    _shares_add_up(plain)
    assert auto["precision"] == plain["precision"] == {"weights": "bfloat16", "activations": "float32", "kv_cache": "bfloat16"}
    # Policy: every weight read by a fused 16-bit matrix-vector dot, no f32 matmul, little conversion.
    assert auto["shares"]["matmul_fp32"] == 0
    assert auto["shares"]["matmul_lowp"] > auto["shares"]["conversion"]
    assert auto["categories"]["scatter"]["ops"] > 0 and auto["categories"]["gather"]["ops"] > 0  # KV writes, rows
    # Forced: the wide matrices are converted to f32 copies (conversion) and read by f32 dots.
    assert plain["shares"]["conversion"] > auto["shares"]["conversion"] + 10
    assert plain["shares"]["matmul_fp32"] > 0
    converted = [op for op in plain["top_ops"] if op["category"] == "conversion"]
    assert converted and all(op["opcodes"] == ["convert"] for op in converted)
    assert {op["read_dtype"] for op in plain["top_ops"] if op["category"] == "matmul_fp32"} == {"f32"}
    # Same weights, same bytes: the roofline numerator does not depend on how XLA reads them.
    assert auto["bytes_per_step"] == plain["bytes_per_step"]
    # The printed report: the table, then the same report as one JSON line; the trace is on disk.
    assert "| dtype conversion |" in stdout and "share of bandwidth roofline" in stdout
    assert json.loads(stdout.strip().splitlines()[-1]) == auto
    assert auto["peak_bandwidth_source"].startswith("measured:") and auto["peak_bandwidth_gbs"] > 0
    assert plain["peak_bandwidth_source"] == "given: --peak-bandwidth" and plain["peak_bandwidth_gbs"] == 30
    assert auto["traced_steps_seen"] == 8 and auto["trace_source"] == "host"
    assert auto["tokens_per_second"] == pytest.approx(1e3 / auto["host_step_ms"])
    assert auto["roofline_percent"] == pytest.approx(
        100 * auto["bytes_per_step"]["total"] / (auto["host_step_ms"] / 1e3) / 1e9 / auto["peak_bandwidth_gbs"])


def test_compare_prints_both_runs_side_by_side(two_runs, tmp_path):
    out, results = two_runs
    a, b = str(out / "auto" / "profile.json"), str(out / "plain" / "profile.json")
    result = CliRunner().invoke(app, ["profile", "--compare", a, b])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.startswith("| dtype conversion |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == [f"{results[k][1]['shares']['conversion']:.1f}%" for k in ("auto", "plain")]
    assert f"| | {a} | {b} |" in result.stdout
    (tmp_path / "bad.json").write_text("{}")
    bad = CliRunner().invoke(app, ["profile", "--compare", a, str(tmp_path / "bad.json")])
    # rich boxes and wraps the error at the terminal's width (COLUMNS=80 in CI): read it as one line
    said = " ".join(re.sub("[\u2500-\u257f]", " ", bad.output).split())
    assert bad.exit_code != 0 and "not a gemmax profile report" in said
    damaged = json.loads(Path(b).read_text())
    del damaged["categories"]  # its schema right, a field the table reads gone
    (tmp_path / "damaged.json").write_text(json.dumps(damaged))
    bad = CliRunner().invoke(app, ["profile", "--compare", a, str(tmp_path / "damaged.json")])
    said = " ".join(re.sub("[\u2500-\u257f]", " ", bad.output).split())
    assert bad.exit_code == 2 and "a report lacks what the comparison reads" in said, bad.output


@pytest.fixture(scope="module")
def speculative_run(tmp_path_factory):
    """The CLI with --speculative ngram --spec-k 4 on gemmax's own random weights of the g4_shared
    config (seed 0), whose greedy text loops within the 32 tokens generated, so prompt lookup's
    proposals are kept (the wide checkpoint's transformers-random weights do not loop that soon):
    its stdout and the report it wrote."""
    from transformers import Gemma4TextConfig

    out = tmp_path_factory.mktemp("spec")
    Gemma4TextConfig(**GEMMA4_CONFIGS["g4_shared"]).save_pretrained(out / "g4_shared")
    result = CliRunner().invoke(app, ["profile", "--model", str(out / "g4_shared"), "--random-weights", "--steps", "4",
                                      "--warmup", "1", "--context", "16", "--peak-bandwidth", "30", "--speculative",
                                      "ngram", "--spec-k", "4", "--spec-tokens", "32", "--out", str(out / "run")])
    assert result.exit_code == 0, result.output
    return out / "run", result.stdout, load(out / "run" / "profile.json")


def test_speculative_profile_carries_the_accepted_lengths_and_the_predicted_speedup(speculative_run, two_runs):
    out, stdout, report = speculative_run
    # The JSON line, not the table text, is what a reader parses (it is the report written to disk).
    assert json.loads(stdout.strip().splitlines()[-1]) == report
    assert report["schema"] == "gemmax.profile/3"
    spec = report["speculative"]
    assert spec["method"] == "ngram" and spec["k"] == 4
    # The histogram: one count per accepted length 0..k, summing to the verify steps the engine ran,
    # weighted to the proposals it accepted; the workload makes prompt lookup pay.
    lengths = spec["accepted_lengths"]
    assert len(lengths) == 5 and all(c >= 0 for c in lengths)
    assert sum(lengths) == spec["verify_steps"] > 0
    assert sum(n * c for n, c in enumerate(lengths)) == spec["accepted"] > 0
    assert spec["accepted"] <= spec["proposed"] <= 4 * spec["verify_steps"]
    # A verify step emits its accepted proposals and one draw; the first token comes from prefill; steps
    # inside a back-off pause (if any) are plain decode steps.
    assert 1 + spec["verify_steps"] + spec["accepted"] <= spec["generated_tokens"] == 32
    assert spec["tokens_match_plain"] and spec["prompt_tokens"] == 16 + 32 + 15
    assert spec["tokens_per_verify_step"] == pytest.approx(1 + spec["accepted"] / spec["verify_steps"])
    # The prediction follows from the figures reported: the decode and verify steps of this run.
    verify = spec["verify"]
    assert spec["decode_step_ms"] == report["host_step_ms"] and spec["verify_step_ms"] == verify["host_step_ms"]
    assert spec["predicted_speedup"] == pytest.approx(
        spec["tokens_per_verify_step"] * report["host_step_ms"] / verify["host_step_ms"])
    assert spec["engine_measured_speedup"] == pytest.approx(
        spec["engine_speculative_tokens_per_second"] / spec["engine_plain_tokens_per_second"])
    # The verify step is profiled as the decode step is: shares that add up, its own trace and ops,
    # the decode step's bytes with k + 1 tokens' gathered rows per row.
    _shares_add_up(verify)
    assert verify["positions_per_row"] == 5 and verify["traced_steps_seen"] == 4
    assert verify["shares"]["matmul_lowp"] > 0
    assert all("verify_rows" in op["op_name"] for op in verify["top_ops"] if op["op_name"])
    assert verify["xplane"].startswith(str(out / "verify"))
    decode_bytes = report["bytes_per_step"]
    assert verify["bytes_per_step"]["gathered"] == 5 * decode_bytes["gathered"]
    assert {k: v for k, v in verify["bytes_per_step"].items() if k not in ("gathered", "total")} == \
        {k: v for k, v in decode_bytes.items() if k not in ("gathered", "total")}
    # The table prints the same figures.
    histogram = " / ".join(f"{n}: {c}" for n, c in enumerate(lengths))
    assert f"| accepted proposals per verify step (n: steps) | {histogram} |" in stdout
    assert f"| predicted speed-up (tokens per verify step x decode / verify step) | {spec['predicted_speedup']:.2f}x |" \
        in stdout
    assert "slowest ops of the verify step:" in stdout
    # A plain run has no speculative block and no speculative rows.
    stdout_plain, plain = two_runs[1]["auto"]
    assert plain["speculative"] is None and "predicted speed-up" not in stdout_plain


def test_compare_reads_old_and_new_reports(speculative_run, two_runs, tmp_path):
    """--compare puts a schema-1 report (before the speculative block) beside a speculative one."""
    out, _, report = speculative_run
    _, plain = two_runs[1]["auto"]
    old = {k: v for k, v in plain.items() if k != "speculative"} | {"schema": "gemmax.profile/1"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    result = CliRunner().invoke(app, ["profile", "--compare", str(tmp_path / "old.json"), str(out / "profile.json")])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.startswith("| predicted speed-up"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == ["n/a", f"{report['speculative']['predicted_speedup']:.2f}x"]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| dtype conversion |"))
    assert [c.strip() for c in row.strip("|").split("|")][1:] == \
        [f"{r['shares']['conversion']:.1f}%" for r in (old, report)]


def test_speculative_flags_are_checked(wide_checkpoint, tmp_path):
    for extra, said in ((["--speculative", "draft"], "off or ngram"), (["--speculative", "ngram", "--spec-k", "3"],
                                                                          "--spec-k must be one of"),
                        (["--speculative", "ngram", "--mesh", "dp=1,tp=1"], "one device")):
        result = CliRunner().invoke(app, ["profile", "--model", str(wide_checkpoint), "--out", str(tmp_path), *extra])
        # rich boxes and wraps the error at the terminal's width: read it as one line
        assert result.exit_code != 0 and said in " ".join(re.sub("[\u2500-\u257f]", " ", result.output).split())


def test_bytes_per_step_by_hand(wide_checkpoint, two_runs, tmp_path):
    """Batch 1 at context 16 (the CLI run) and batch 2 at context 40 (a second, short run)."""
    H, V, P, L, nh, nkv, window = 64, 128, 8, 6, 4, 2, 4
    hd = {"S": 16, "F": 32}
    kinds = ["S", "F", "S", "S", "F", "F"]  # layers 3-5 share the KV of layers 2 (S) and 1 (F)
    owns = [True, True, True, False, False, False]
    mlp = [4160, 4160, 4160, 8320, 8320, 8320]  # double-wide MLP on the KV-sharing layers
    params = 0
    for kind, own, inter in zip(kinds, owns, mlp, strict=True):
        d = hd[kind]
        params += nh * d * H + H * nh * d  # q, o
        params += 2 * nkv * d * H if own else 0  # k, v (sharing layers have none)
        params += 3 * inter * H + 2 * P * H  # gate, up, down; PLE gate and projection
    params += L * P * H  # the model-level PLE projection
    lm_head = V * H * 2  # the tied embedding table, read whole by the LM head

    def kv(batch, context):  # every attention layer reads what it sees; bf16 cache (the CPU policy's)
        return batch * sum((min(context, window) if k == "S" else context) * 2 * nkv * hd[k] * 2 for k in kinds)

    config = ModelConfig.from_dir(wide_checkpoint)
    norms = 4 * sum(math.prod(s.shape) for s in param_specs(config) if s.kind in ("norm", "scalar"))
    _, auto = two_runs[1]["auto"]
    expected = {"matrices": 2 * params, "lm_head": lm_head, "gathered": 1 * (H + L * P) * 2, "norms": norms,
                "kv": kv(1, 16)}
    assert auto["bytes_per_step"] == {**expected, "total": sum(expected.values())}
    assert "PLE" in auto["bytes_note"] and "whole" in auto["bytes_note"]

    weights, config, policy, name = load_weights(str(wide_checkpoint))
    wide = profile_decode(weights, config, policy, out_dir=tmp_path, steps=2, warmup=1, batch=2, context=40,
                          peak_gbs=30, model=name)
    expected.update(gathered=2 * (H + L * P) * 2, kv=kv(2, 40))  # rows per token; KV grows with context
    assert wide["bytes_per_step"] == {**expected, "total": sum(expected.values())}
    assert wide["roofline_tokens_per_second"] == pytest.approx(2 * 30e9 / wide["bytes_per_step"]["total"])
    _shares_add_up(wide)
    assert wide["shares"]["matmul_lowp"] > 0 and wide["shares"]["matmul_fp32"] == 0  # batch 2: bf16 GEMMs


def test_classifier_rules_on_a_compiled_function():
    """Fused bf16 dot -> 16-bit matmul; a weight too wide for the fusion -> a convert op (conversion)
    feeding an f32 dot; an activation-only dot -> attention; a table lookup -> gather."""

    def step(params, x, ids):
        a = linear(x, params["narrow"])  # [1, 256]
        b = linear(jnp.tile(x, (1, 9))[:, :4160], params["wide"])  # [1, 128], in = 4160 > 4095
        scores = jnp.einsum("bd,td->bt", a[:, :64], jnp.tanh(a[:, 64:].reshape(3, 64)))
        return a.sum() + b.sum() + scores.sum() + lookup(params["table"], ids, jnp.float32).sum()

    params = {"narrow": jnp.ones((256, 512), jnp.bfloat16), "wide": jnp.ones((128, 4160), jnp.bfloat16),
              "table": jnp.ones((100, 32), jnp.bfloat16)}
    compiled = jax.jit(step).lower(params, jnp.ones((1, 512)), jnp.array([3, 5])).compile()
    index = HloIndex.from_compiled(compiled)
    classifier = Classifier(index)
    entry = [comp for name, comp in index.computations.items() if name.startswith("main")][0]
    ops = {name: classifier.classify(name) for name, i in entry.items() if i.opcode != "parameter"}
    by_cat = {}
    for name, info in ops.items():
        by_cat.setdefault(info.category, []).append((name, info))
    assert {info.read_dtype for _, info in by_cat["matmul_lowp"]} == {"bf16"}
    assert {info.read_dtype for _, info in by_cat["matmul_fp32"]} == {"f32"}
    assert "attention" in by_cat and "gather" in by_cat
    # The f32 dot reads the wide weight through an f32 copy made by a conversion op from the bf16 parameter.
    (fp32_dot, _), = by_cat["matmul_fp32"]
    (copy,) = [o for o in index.instrs[fp32_dot].operands if classifier.is_weight(o)]
    assert ops[copy].category == "conversion" and ops[copy].opcodes == ("convert",)
    assert [entry[o].op_name for o in entry[copy].operands] == ["params['wide']"]


def test_exclusive_time_of_nested_events():
    """A conditional's event encloses its branch's ops on the same thread: each is charged once."""
    events = [(0, 100, {"hlo_op": "cond"}), (10, 40, {"hlo_op": "a"}), (50, 90, {"hlo_op": "b"}),
              (60, 70, {"hlo_op": "c"}), (120, 130, {"hlo_op": "d"})]
    exclusive = {e[2]["hlo_op"]: e[3] for e in _exclusive(events)}
    assert exclusive == {"cond": 30, "a": 30, "b": 30, "c": 10, "d": 10}
    assert sum(exclusive.values()) == 110  # the busy time, nothing counted twice


def test_ops_of_a_tpu_trace_without_module_stats(monkeypatch):
    """A TPU v5e trace (jax 0.10.2, the first TPU device check) names each op event by the instruction's
    text and gives it no module stats; the module's runs are spans on the "XLA Modules" line. The ops
    inside a span of the module are its ops in that run; ops of other modules and outside every span
    are not."""
    from types import SimpleNamespace as NS

    def event(name, start, end, **stats):
        return NS(name=name, start_ns=start, end_ns=end, stats=list(stats.items()))

    modules = NS(name="XLA Modules", events=[event("jit_decode_step(1433)", 100, 200, run_id="7"),
                                             event("jit_subtract(58)", 210, 220, run_id="8"),
                                             event("jit_decode_step(1433)", 300, 400, run_id="9")])
    ops = NS(name="XLA Ops", events=[
        event("%copy-start.58 = (f32[512]{0:T(512)S(1)}) copy-start(f32[512]{0} %p.1)", 100, 110),
        event("%fusion.3 = bf16[1,1536]{1,0} fusion(%a, %b), kind=kOutput", 120, 190),
        event("%subtract.1 = f32[] subtract(%x, %y)", 211, 219),  # jit_subtract's
        event("%fusion.3 = bf16[1,1536]{1,0} fusion(%a, %b), kind=kOutput", 310, 390)])
    plane = NS(name="/device:TPU:0", lines=[NS(name="_counters_", events=[]), modules, ops])
    assert _ops_in_module_spans(plane, "jit_decode_step") == [
        (100, 110, {"hlo_op": "copy-start.58", "run_id": "7"}), (120, 190, {"hlo_op": "fusion.3", "run_id": "7"}),
        (310, 390, {"hlo_op": "fusion.3", "run_id": "9"})]
    assert _ops_in_module_spans(plane, "jit_decode") == []  # a module name is matched whole
    root = NS(name="XLA Ops", events=[event("ROOT %tuple.1 = (f32[4]{0}) tuple(%a)", 390, 400)])
    assert _ops_in_module_spans(NS(name="/device:TPU:0", lines=[modules, root]), "jit_decode_step") == [
        (390, 400, {"hlo_op": "tuple.1", "run_id": "9"})]

    # op_times reads such a trace through them: two runs of the module, its ops' median per run.
    from jax.profiler import ProfileData

    plane.stats = []
    monkeypatch.setattr(ProfileData, "from_file", staticmethod(lambda path: NS(planes=[plane])))
    times = op_times("trace.xplane.pb", "jit_decode_step", steps=2)
    assert times.source == "device" and times.steps == 2
    assert times.per_op_ns == {"copy-start.58": 5.0, "fusion.3": 75.0}  # medians of (10, 0) and (70, 80)


def test_peak_bandwidth_table():
    expected = {"Tesla T4": 320, "NVIDIA T4G": 320, "NVIDIA L4": 300, "NVIDIA A10G": 600,
                "NVIDIA A100-SXM4-40GB": 1555, "NVIDIA A100-SXM4-80GB": 2039, "NVIDIA A100 80GB PCIe": 1935,
                "NVIDIA H100 80GB HBM3": 3350, "NVIDIA H100 PCIe": 2000, "NVIDIA H200": 4800,
                "TPU v5 lite": 819, "TPU v6 lite": 1640}
    assert {kind: spec_bandwidth(kind).gbs for kind in expected} == expected
    assert spec_bandwidth("AMD EPYC 9B14 (2 cores)") is None
    assert peak_bandwidth("NVIDIA L4", "gpu").source.startswith("spec: NVIDIA L4")
    assert peak_bandwidth("NVIDIA L4", "gpu", given_gbs=250.0).gbs == 250.0
    reported = peak_bandwidth("NVIDIA GeForce RTX 4090", "gpu", reported_bytes_per_s=1.008e12)
    assert reported.gbs == pytest.approx(1008) and reported.source.startswith("device: reported")
    assert peak_bandwidth("NVIDIA GeForce RTX 4090", "gpu") is None  # never the host's bandwidth for a GPU
    with pytest.raises(ValueError, match="must be > 0"):
        peak_bandwidth("cpu", "cpu", given_gbs=0.0)


def test_dot_flops_counts_scans_and_the_costliest_branch():
    """2 m n k per dot_general, a scan's body times its length, a conditional's costliest branch."""
    from gemmax.profile.prefill import dot_flops

    def f(x, w, on):
        y = x @ w  # [8, 16] x [16, 32]
        _, ys = jax.lax.scan(lambda c, wt: (c, x @ wt), None, jnp.stack([w] * 3))  # 3 more of the same
        z = jax.lax.cond(on, lambda y: y @ w.T @ w, lambda y: y, y)  # [8,32]x[32,16], [8,16]x[16,32]
        return y, ys, z

    args = jnp.ones((8, 16)), jnp.ones((16, 32)), True
    assert dot_flops(jax.make_jaxpr(f)(*args)) == 4 * 2 * 8 * 16 * 32 + 2 * (2 * 8 * 32 * 16)


def test_classifier_follows_weights_into_loops_and_branches():
    """The int8 prefill GEMM loops over weight tiles (quant.int8): the dot reading a converted tile
    is a matmul and the tile's convert is conversion; a weight used in a conditional branch (the LM
    head on a prompt's last chunk) is still a weight there."""
    from gemmax.quant.int8 import quantize_int8

    params = {"w": quantize_int8(jnp.ones((2048, 640), jnp.bfloat16), "cpu"), "head": jnp.ones((4096, 640))}

    def step(params, x, on):
        y = linear(x, params["w"])[:, :640]
        return jax.lax.cond(on, lambda y: y @ params["head"].T, lambda y: jnp.zeros((32, 4096)), y)

    index = HloIndex.from_compiled(jax.jit(step).lower(params, jnp.ones((32, 640)), True).compile())
    classifier = Classifier(index)
    timed = [name for name, i in index.instrs.items() if index.home[name] not in
             {i.calls for i in index.instrs.values() if i.calls} and i.opcode not in ("parameter", "tuple")]
    kinds = {name: classifier.classify(name) for name in timed}
    matmuls = [n for n, info in kinds.items() if info.category.startswith("matmul")]
    assert len(matmuls) == 2 and not any(info.category == "attention" for info in kinds.values())
    assert {index.home[n] in classifier._loops for n in matmuls} == {True, False}
    assert any(info.category == "conversion" and index.home[n] in classifier._loops for n, info in kinds.items())


def test_prefill_profile_reports_flops_and_the_compute_peak(wide_checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["profile", "--model", str(wide_checkpoint), "--prefill", "16", "--steps", "3",
                                      "--warmup", "1", "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    report = load(tmp_path / "p" / "profile.json")
    assert report["step"] == "prefill" and report["context"] == 0
    assert report["kv_bounds"] == [16]  # the engine's bounds: at context 0 the chunk reads no past
    _shares_add_up(report)
    p = report["prefill"]
    assert p["flops_per_chunk"] > 2 * 16 * WIDE["vocab_size"] * WIDE["hidden_size"]  # the head alone
    assert p["achieved_gflops"] == pytest.approx(p["flops_per_chunk"] / report["host_step_ms"] * 1e3 / 1e9)
    assert p["peak_gflops"] == max(r["gflops"] for r in p["gemm_rates"]) > 0
    assert p["peak_percent"] == pytest.approx(100 * p["achieved_gflops"] / p["peak_gflops"])
    assert "| share of compute peak |" in result.stdout
    decode = CliRunner().invoke(app, ["profile", "--compare", str(tmp_path / "p" / "profile.json"),
                                      str(tmp_path / "p" / "profile.json")])
    assert decode.exit_code == 0, decode.output
