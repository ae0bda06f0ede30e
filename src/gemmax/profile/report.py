"""The profile report: a JSON-able dict (`profile.json`) and the table printed from one or more of them.

The table is rendered from the JSON alone, so `gemmax profile --compare A.json B.json` puts two runs
(two devices, two dtypes) side by side with the same code that prints a single run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gemmax.profile.hlo import CATEGORIES

# /2 adds `speculative` (None, or the verify step and the accepted lengths); /3 adds `step` ("decode",
# or "prefill" with the `prefill` block of `gemmax profile --prefill`; older reports are decode).
SCHEMA = "gemmax.profile/3"
READABLE = ("gemmax.profile/1", "gemmax.profile/2", SCHEMA)  # what `load` (and so --compare) reads

# The four shares of the headline table (they sum to 100%) and the fine categories behind the last one.
SHARES = ("conversion", "matmul_fp32", "matmul_lowp", "other")
OTHER = tuple(c for c in CATEGORIES if c not in SHARES)
LABELS = {
    "conversion": "dtype conversion",
    "matmul_fp32": "matrix-vector / matmul in fp32",
    "matmul_lowp": "matmul in 16-bit / int8",
    "other": "attention, gather (PLE, embedding), other",
    "attention": "  of which attention (q.k, p.v)",
    "gather": "  of which gather (embedding, PLE rows)",
    "scatter": "  of which scatter (KV cache writes)",
    "reduce": "  of which reduce (norms, softmax, sampling)",
    "copy": "  of which copies / layout",
    "elementwise": "  of which elementwise",
    "control": "  of which control flow (conditional, while)",
    "collective": "  of which collectives (all-reduce, all-gather: --mesh)",
}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


def _num(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:,.1f}{unit}"


def _tensor_core(report: dict[str, Any]) -> str:
    share = report["tensor_core_percent"]
    return report["tensor_core_note"] if share is None else f"{_pct(share)} ({report['tensor_core_note']})"


def _bytes(n: float) -> str:
    if n < 1e6:
        return f"{n / 1e3:,.1f} kB"
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.3f} GB"


def step_of(report: dict[str, Any]) -> str:
    """"decode" or "prefill": the step a report profiles (reports before schema /3 are decode)."""
    return report.get("step", "decode")


def _time_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The op categories and step times every report has, decode or prefill."""
    cats = report["categories"]
    out = [(LABELS[k], _pct(report["shares"][k])) for k in SHARES]
    out += [(LABELS[k], _pct(cats[k]["percent"]) if k in cats else "n/a") for k in OTHER]  # older reports lack some
    return out + [
        ("ops with a convert fused into other work", _pct(report["fused_convert_percent"])),
        ("tensor-core / MXU use (where the device reports it)", _tensor_core(report)),
        ("total device time per step (sum of op times)", f"{report['device_ms_per_step']:.3f} ms"),
        ("step time in the trace (first op start to last op end)", f"{report['trace_step_ms']:.3f} ms"),
        ("step time, untraced (host clock)", f"{report['host_step_ms']:.3f} ms"),
    ]


def prefill_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of a `gemmax profile --prefill` report, in table order."""
    p = report["prefill"]
    flops = p["flops_per_chunk"]
    return _time_rows(report) + [
        ("prefill tok/s (chunk tokens / untraced step time)", f"{p['tokens_per_second']:,.1f}"),
        ("FLOPs per chunk (the dot_generals of the step)", "n/a" if flops is None else f"{flops / 1e9:,.3f} GFLOP"),
        ("achieved compute (FLOPs / untraced step time)", _num(p["achieved_gflops"], " GFLOP/s")),
        ("GEMMs measured in this run (m x k x n dtype: GFLOP/s)",
         "; ".join(f"{r['label']}: {r['gflops']:,.1f}" for r in p["gemm_rates"])),
        ("compute peak (best GEMM measured)", _num(p["peak_gflops"], " GFLOP/s")),
        ("share of compute peak", _pct(p["peak_percent"])),
        ("share of a GEMM at this chunk's shapes", _pct(p["own_shape_percent"])),
    ]


def rows(report: dict[str, Any], speculative: bool | None = None) -> list[tuple[str, str]]:
    """(label, value) rows of one report, in table order; with `speculative` (default: whether the
    report has a `speculative` block) the rows of `speculative_rows` after them. A prefill report
    has its own rows (`prefill_rows`)."""
    if step_of(report) == "prefill":
        return prefill_rows(report)
    b = report["bytes_per_step"]
    out = _time_rows(report) + [
        ("decode tok/s (same run)", f"{report['tokens_per_second']:.1f}"),
        ("bytes read per step (weights actually read + KV)", _bytes(b["total"])),
        ("  weight matrices / LM head / gathered rows / norms",
         f"{_bytes(b['matrices'])} / {_bytes(b['lm_head'])} / {_bytes(b['gathered'])} / {_bytes(b['norms'])}"),
        ("  KV at this context", _bytes(b["kv"])),
        ("peak bandwidth (device spec or measured)", _num(report["peak_bandwidth_gbs"], " GB/s")),
        ("  source", report["peak_bandwidth_source"]),
        ("achieved bandwidth (bytes per step / untraced step time)", _num(report["achieved_gbs"], " GB/s")),
        ("roofline tok/s (batch x peak / bytes per step)", _num(report["roofline_tokens_per_second"])),
        ("share of bandwidth roofline", _pct(report["roofline_percent"])),
    ]
    if speculative or (speculative is None and report.get("speculative")):
        out += speculative_rows(report.get("speculative"))
    return out


def _histogram(counts: list[int]) -> str:
    return " / ".join(f"{n}: {c}" for n, c in enumerate(counts))


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def speculative_rows(spec: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The rows of `gemmax profile --speculative`: the verify step, the accepted lengths of the
    engine's generation and the predicted speed-up ("n/a" for a run without them)."""
    labels = [
        "speculative decoding (method, proposals k)",
        "verify step: conversion / fp32 / 16-bit matmul / other",
        "verify step: total device time (sum of op times)",
        "verify step time, untraced (host clock)",
        "verify step: bytes read / share of bandwidth roofline",
        "generation: verify steps / proposed / accepted",
        "accepted proposals per verify step (n: steps)",
        "tokens per verify step (1 + accepted / steps)",
        "decode step / verify step (untraced)",
        "predicted speed-up (tokens per verify step x decode / verify step)",
        "engine, same prompt: plain / speculative tok/s (measured speed-up)",
        "greedy speculative tokens equal plain decoding",
    ]
    if not spec:
        return [(label, "n/a") for label in labels]
    v = spec["verify"]
    shares = " / ".join(_pct(v["shares"][k]) for k in SHARES)
    values = [
        f"{spec['method']}, k={spec['k']} ({v['positions_per_row']} positions per row)",
        shares,
        f"{v['device_ms_per_step']:.3f} ms",
        f"{v['host_step_ms']:.3f} ms",
        f"{_bytes(v['bytes_per_step']['total'])} / {_pct(v['roofline_percent'])}",
        f"{spec['verify_steps']} / {spec['proposed']} / {spec['accepted']}",
        _histogram(spec["accepted_lengths"]),
        "n/a" if spec["tokens_per_verify_step"] is None else f"{spec['tokens_per_verify_step']:.3f}",
        f"{spec['decode_step_ms']:.3f} ms / {spec['verify_step_ms']:.3f} ms",
        _times(spec["predicted_speedup"]),
        f"{spec['engine_plain_tokens_per_second']:.1f} / {spec['engine_speculative_tokens_per_second']:.1f} "
        f"({_times(spec['engine_measured_speedup'])})",
        "yes" if spec["tokens_match_plain"] else "NO",
    ]
    return list(zip(labels, values, strict=True))


def _header(report: dict[str, Any]) -> str:
    p = report["precision"]
    shape = (f"prefill chunk of {report['prefill']['tokens']} tokens" if step_of(report) == "prefill"
             else f"batch {report['batch']}")
    return (f"{report['device']['kind']}: weights {p['weights']}, activations {p['activations']}, "
            f"KV {p['kv_cache']}, {shape}, context {report['context']}"
            + (f", mesh {report['mesh']} (device time summed over its {report['devices']} devices)"
               if report.get("mesh") else ""))


def table(reports: list[dict[str, Any]], titles: list[str] | None = None) -> str:
    """A Markdown table with one column per report."""
    if not reports:
        raise ValueError("no reports to show")
    titles = titles or (["this run"] if len(reports) == 1 else [f"run {chr(65 + i)}" for i in range(len(reports))])
    if len({step_of(r) for r in reports}) > 1:
        raise ValueError("cannot put a decode profile beside a prefill profile: compare runs of the same step")
    speculative = any(r.get("speculative") for r in reports)  # every column gets the same rows
    columns = [rows(r, speculative) for r in reports]
    lines = ["| | " + " | ".join(titles) + " |", "|---|" + "---|" * len(reports)]
    for i, (label, _) in enumerate(columns[0]):
        lines.append(f"| {label} | " + " | ".join(col[i][1] for col in columns) + " |")
    legend = [f"{title}: {report.get('model', '?')} on {_header(report)}" for title, report in zip(titles, reports, strict=True)]
    return "\n".join(lines + [""] + legend)


def top_ops_table(report: dict[str, Any], n: int = 12) -> str:
    """The slowest ops of one run (or of its verify step: `report["speculative"]["verify"]`) with
    their category and fused opcodes."""
    lines = ["| op | category | ms/step | share | fused opcodes | read dtype |", "|---|---|---|---|---|---|"]
    for op in report["top_ops"][:n]:
        lines.append(f"| {op['name']} | {op['category']} | {op['ms_per_step']:.4f} | {op['percent']:.1f}% | "
                     f"{' '.join(op['opcodes'])} | {op['read_dtype'] or ''} |")
    return "\n".join(lines)


def load(path: str | Path) -> dict[str, Any]:
    """A report written by `gemmax profile` (its `profile.json`)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a profile report from {path}: {exc}") from exc
    if not isinstance(report, dict) or report.get("schema") not in READABLE:
        raise ValueError(f"{path} is not a gemmax profile report (want schema {' or '.join(map(repr, READABLE))})")
    return report
