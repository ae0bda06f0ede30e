"""Side-by-side tables across rigs (`gemmax bench compare A.json B.json ...`).

Cross-rig figures are wire (stream) figures only: every run streams, so every rig has one, measured
the same way. A server's own gauge appears only in its own rig's column with its own gauge/wire
ratio; it is never divided by another rig's number, and a gauge/wire ratio measured on one rig is
never applied to another. Ratios are against the first file (the baseline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.table import Table

from gemmax.bench.report import TTFT_NOTE, fmt, fmt_range, fmt_ttft, load_level

PRECISION_KEYS = ("weights", "activations", "kv_cache")


@dataclasses.dataclass
class Comparison:
    columns: list[str]
    rows: list[list[str]]
    notes: list[str]


def _key(cell: dict[str, Any]) -> tuple:
    return (cell["input_len"], cell["output_len"], cell.get("concurrency"), cell.get("request_rate"))


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _median(stats: dict[str, Any] | None) -> float | None:
    return stats["median"] if stats else None


def _sampling(run: dict[str, Any]) -> str:
    return run.get("sampling") or "greedy"  # files written before the harness had --sampling: greedy


def compare_runs(runs: list[dict[str, Any]]) -> Comparison:
    if len(runs) < 2:
        raise ValueError("compare needs at least two result files")
    labels = [r["label"] for r in runs]
    if len(set(labels)) < len(labels):  # same label twice: tell the columns apart by position
        labels = [f"{label} #{i + 1}" for i, label in enumerate(labels)]
    base = labels[0]
    by_run = [{_key(c): c for c in r["cells"]} for r in runs]
    keys: list[tuple] = []
    for cells in by_run:
        keys += [k for k in cells if k not in keys]
    gauged = [i for i, r in enumerate(runs) if any(c.get("gauge") for c in r["cells"])]
    priced = [i for i, r in enumerate(runs) if any(c.get("cost_per_million_output_tokens") for c in r["cells"])]

    columns = ["input", "output", "load"]
    columns += [f"{label} tok/s" for label in labels]
    columns += [f"{label} TTFT ms" for label in labels]
    columns += [f"{label}/{base} tok/s" for label in labels[1:]]
    columns += [f"{label}/{base} TTFT" for label in labels[1:]]
    columns += [f"{label} out tok/s" for label in labels]
    columns += [f"{label}/{base} out tok/s" for label in labels[1:]]
    columns += [col for i in gauged for col in (f"{labels[i]} own gauge", f"{labels[i]} gauge/wire")]
    columns += [f"{labels[i]} $/M out" for i in priced]

    rows = []
    for key in keys:
        cells = [cells.get(key) for cells in by_run]
        any_cell = next(c for c in cells if c is not None)
        stream = [_median(c["stream"]) if c else None for c in cells]
        ttft = [c["median_ttft_ms"] if c else None for c in cells]
        row = [str(key[0]), str(key[1]), load_level(any_cell)]
        row += [fmt_range(c["stream"]) if c else "-" for c in cells]
        row += [fmt_ttft(c) if c else "-" for c in cells]
        row += [_ratio(s, stream[0]) for s in stream[1:]]
        row += [_ratio(t, ttft[0]) for t in ttft[1:]]
        output = [c.get("output_throughput") if c else None for c in cells]
        row += [fmt(o) for o in output]
        row += [_ratio(o, output[0]) for o in output[1:]]
        for i in gauged:
            c = cells[i]
            flagged = bool(c and c.get("gauge_resolution") and c["gauge_resolution"]["flagged"])
            row += [(fmt_range(c.get("gauge")) + (" !" if flagged else "")) if c else "-",
                    fmt_range(c.get("ratio"), 3) if c else "-"]
        row += [fmt(cells[i].get("cost_per_million_output_tokens"), 3) if cells[i] else "-" for i in priced]
        rows.append(row)

    notes = [f"tok/s = wire decode rate, 1 / the median TPOT over every measured request (as vllm bench "
             f"serve), with the lowest and highest round's in parentheses; out tok/s = output tokens of the whole cell / its duration (what several users get "
             f"together: a server that runs one request at a time keeps a high per-request rate and queues "
             f"the rest in TTFT); {TTFT_NOTE}; ratios against {base}."]
    if gauged:
        notes.append("own gauge = that rig's server-reported decode rate, shown beside its own wire figure "
                     "only; gauges are never compared across rigs. '!' = gauge tick coarser than the "
                     "run-to-run spread.")
    for label, run in zip(labels, runs, strict=True):
        server = run["server"]
        notes.append(f"{label}: model {run['model']}, prompts {run['prompt_mode']}, sampling {_sampling(run)}, "
                     f"output forced {run['forced_output']}, precision {server['precision_before']}, "
                     f"degenerate responses {server['degenerate_responses_before']} -> "
                     f"{server['degenerate_responses_after']}")
    dtypes = {tuple((r["server"]["precision_before"] or {}).get(k) for k in PRECISION_KEYS) for r in runs}
    if len(dtypes) > 1:
        notes.append(f"WARNING: the rigs report different {'/'.join(PRECISION_KEYS)} dtypes; "
                     "the comparison mixes precisions.")
    samplings = {_sampling(run) for run in runs}
    if len(samplings) > 1:
        notes.append(f"WARNING: the runs sample differently ({', '.join(sorted(samplings))}); a sampled rate is "
                     "a claim apart from a greedy one, and their ratios compare sampling settings, not rigs.")
    unheld = [label for label, run in zip(labels, runs, strict=True)
              if any(c.get("output_len_verified") is False for c in run["cells"])]
    if unheld:
        notes.append(f"WARNING: output length not held on {', '.join(unheld)}; TPOT figures differ in length.")
    return Comparison(columns=columns, rows=rows, notes=notes)


def to_rich(comparison: Comparison, title: str = "gemmax bench compare") -> Table:
    table = Table(title=title)
    for name in comparison.columns:
        table.add_column(name, justify="right")
    for row in comparison.rows:
        table.add_row(*row)
    return table


def to_markdown(comparison: Comparison) -> str:
    lines = ["| " + " | ".join(comparison.columns) + " |",
             "|" + "|".join("---:" for _ in comparison.columns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in comparison.rows]
    lines += [""] + [f"- {note}" for note in comparison.notes]
    return "\n".join(lines) + "\n"
