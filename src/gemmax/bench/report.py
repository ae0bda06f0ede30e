"""Terminal and file output of one sweep: a rich table, the JSON file, and a one-line summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_range(stats: dict[str, Any] | None, digits: int = 1) -> str:
    """'12.3 (12.1-12.6)': the figure (a cell's: over every measured request) with the lowest and
    highest round's."""
    if not stats:
        return "-"
    if stats["n"] == 1:
        return fmt(stats["median"], digits)
    return f"{fmt(stats['median'], digits)} ({fmt(stats['min'], digits)}-{fmt(stats['max'], digits)})"


def fmt_ttft(cell: dict[str, Any]) -> str:
    """'105.5 (98.2-120.3)': the median TTFT over every measured request of the cell (the JSON line's
    `median_ttft_ms`, as `vllm bench serve` computes it), then the lowest and highest round median.
    A round of several concurrent requests has its own median, and the median of those is not the
    median over all of them: every table shows the median over all of them, as the JSON line does."""
    rounds = cell["ttft"]
    if not rounds or rounds["n"] == 1:
        return fmt(cell["median_ttft_ms"])
    return f"{fmt(cell['median_ttft_ms'])} ({fmt(rounds['min'])}-{fmt(rounds['max'])})"


TTFT_NOTE = ("TTFT ms = median over every measured request (the JSON line's median_ttft_ms, as vllm bench "
             "serve); decode tok/s (wire) = 1 / TPOT ms; gauge and gauge/wire = medians over every measured "
             "request; in parentheses the lowest and highest round's figure")


def load_level(cell: dict[str, Any]) -> str:
    return f"{cell['request_rate']:g} req/s" if cell.get("request_rate") else f"c={cell['concurrency']}"


def run_table(result: dict[str, Any]) -> Table:
    cells = result["cells"]
    has_gauge = any(c["gauge"] for c in cells)
    has_cost = any(c["cost_per_million_output_tokens"] is not None for c in cells)
    table = Table(title=f"{result['label']}  ({result['model']}, decode source: {result['decode_source']}, "
                        f"prompts: {result['prompt_mode']})", caption=TTFT_NOTE)
    for name in ("input", "load", "ok/fail", "TTFT ms", "TPOT ms", "p99 ITL ms", "decode tok/s (wire)"):
        table.add_column(name, justify="right")
    if has_gauge:
        table.add_column("gauge tok/s", justify="right")
        table.add_column("gauge/wire", justify="right")
    table.add_column("out tok/s", justify="right")
    if has_cost:
        table.add_column("$/M out tok", justify="right")
    table.add_column("flags")
    for c in cells:
        row = [str(c["input_len"]), load_level(c), f"{c['completed']}/{c['failed']}", fmt_ttft(c),
               fmt(c["median_tpot_ms"], 2), fmt(c["p99_itl_ms"], 2), fmt_range(c["stream"])]
        if has_gauge:
            res = c["gauge_resolution"]
            mark = " !" if res and res["flagged"] else ""
            row += [fmt_range(c["gauge"]) + mark, fmt_range(c["ratio"], 3)]
        row.append(fmt(c["output_throughput"]))
        if has_cost:
            row.append(fmt(c["cost_per_million_output_tokens"], 3))
        row.append("; ".join(c["flags"]))
        table.add_row(*row)
    return table


def wide_console(**kwargs) -> Console:
    """A console that does not squeeze tables into 80 columns when output is piped to a file."""
    console = Console(**kwargs)
    return console if console.is_terminal else Console(width=200, **kwargs)


def print_run(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or wide_console()
    console.print(run_table(result))
    server = result["server"]
    console.print(f"precision before: {server['precision_before']}  after: {server['precision_after']}")
    if server["degenerate_responses_before"] is not None or server["degenerate_responses_after"] is not None:
        console.print(f"degenerate responses: {server['degenerate_responses_before']} -> "
                      f"{server['degenerate_responses_after']}")
    if not result["forced_output"]:
        console.print("note: the server refused ignore_eos/min_tokens; output lengths are as generated")


def run_flags(result: dict[str, Any]) -> list[str]:
    """Every cell's flags, and where the sweep stopped if it did."""
    aborted = [f"aborted: {result['aborted']}"] if result.get("aborted") else []
    return [flag for cell in result["cells"] for flag in cell["flags"]] + aborted


def summary_line(result: dict[str, Any]) -> str:
    """One JSON line: the headline figures of every cell (and `aborted`, for a sweep that stopped)."""
    return json.dumps({
        "label": result["label"], "model": result["model"], "decode_source": result["decode_source"],
        "cells": [{"input_len": c["input_len"], "concurrency": c["concurrency"],
                   "request_rate": c["request_rate"], "completed": c["completed"], "failed": c["failed"],
                   "decode_tok_s": c["decode_tok_s"], "median_ttft_ms": c["median_ttft_ms"],
                   "output_throughput": c["output_throughput"]} for c in result["cells"]],
        **({"aborted": result["aborted"]} if result.get("aborted") else {}),
    })


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def load_run(path: Path) -> dict[str, Any]:
    from gemmax.bench.sweep import SCHEMA

    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a gemmax bench result (schema {data.get('schema')!r}, want {SCHEMA!r})")
    return data
