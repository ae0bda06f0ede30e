"""`gemmax bench` and `gemmax bench compare` through the CLI, against scripted servers: result files,
the terminal table, and cross-rig tables that compare wire figures only."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from bench_fake_server import FakeServer, Script
from gemmax.bench.compare import compare_runs, to_markdown
from gemmax.bench.report import fmt_range, fmt_ttft, load_run, run_table, summary_line
from gemmax.bench.sweep import SweepConfig, summarize_cell
from gemmax.bench.timing import RequestRecord
from gemmax.cli import app

# Cross-run tok/s ratios of a scripted stream (20 ms gaps) must stay within 0.8-1.25: `make test`
# runs this module alone, not beside a worker that compiles on both cores (pyproject.toml's markers).
pytestmark = pytest.mark.wire_timing

runner = CliRunner()


def run_bench(server: FakeServer, out, *extra: str):
    with server.in_thread():
        result = runner.invoke(app, ["bench", "--base-url", server.base_url, "--input-lens", "8,24",
                                     "--output-len", "6", "--repeats", "2", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return result


def test_bench_cli_writes_json_table_and_summary_line(tmp_path):
    out = tmp_path / "a.json"
    result = run_bench(FakeServer(Script(ttft=0.01, itl=0.005, gauge=lambda x: round(x, 1))), out,
                       "--label", "fake-a", "--price-per-hour", "2.0", "--plot", str(tmp_path / "a.png"))
    data = load_run(out)
    assert data["label"] == "fake-a" and data["decode_source"] == "both"
    assert [c["input_len"] for c in data["cells"]] == [8, 24]
    assert "fake-a" in result.stdout and "decode tok/s" in result.stdout
    summary = json.loads(result.stdout.strip().splitlines()[-1])  # the run ends with one JSON line
    assert [c["decode_tok_s"] for c in summary["cells"]] == [c["decode_tok_s"] for c in data["cells"]]
    assert all(c["cost_per_million_output_tokens"] > 0 for c in data["cells"])
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cli_refuses_missing_base_url_and_bad_lists():
    result = runner.invoke(app, ["bench"])
    assert result.exit_code != 0 and "--base-url" in result.output
    result = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--input-lens", "4,x"])
    assert result.exit_code != 0 and "--input-lens" in result.output


def test_compare_uses_wire_figures_across_rigs(tmp_path):
    # Rig A reports a gauge twice its real rate and is benched with --decode-source gauge; rig B has
    # no gauge. Both decode at the same real pace, so the cross-rig ratio must be ~1, not ~0.5.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    run_bench(FakeServer(Script(ttft=0.01, itl=0.02, gauge=lambda x: 2 * x)), a, "--label", "rigA",
              "--decode-source", "gauge")
    run_bench(FakeServer(Script(ttft=0.02, itl=0.02)), b, "--label", "rigB")
    run_a, run_b = load_run(a), load_run(b)
    assert run_a["cells"][0]["decode_tok_s"] == run_a["cells"][0]["gauge"]["median"]  # its headline is the gauge

    comparison = compare_runs([run_a, run_b])
    cols = comparison.columns
    assert "rigA own gauge" in cols and "rigB own gauge" not in cols
    assert not any("gauge" in c and "/" in c and "rigB" in c for c in cols)  # no cross-rig gauge ratio
    for row, cell_a, cell_b in zip(comparison.rows, run_a["cells"], run_b["cells"], strict=True):
        assert row[cols.index("rigA tok/s")] == fmt_range(cell_a["stream"])
        assert row[cols.index("rigB tok/s")] == fmt_range(cell_b["stream"])
        want = cell_b["stream"]["median"] / cell_a["stream"]["median"]
        assert row[cols.index("rigB/rigA tok/s")] == f"{want:.2f}x"
        assert 0.8 < want < 1.25
        ttft = cell_b["median_ttft_ms"] / cell_a["median_ttft_ms"]
        assert row[cols.index("rigB/rigA TTFT")] == f"{ttft:.2f}x"
        output = cell_b["output_throughput"] / cell_a["output_throughput"]
        assert row[cols.index("rigB/rigA out tok/s")] == f"{output:.2f}x"

    result = runner.invoke(app, ["bench", "compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "rigA" in result.stdout and "rigB" in result.stdout and "never compared across rigs" in result.stdout
    result = runner.invoke(app, ["bench", "compare", str(a), str(b), "--markdown", "--plot", str(tmp_path / "c.png")])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("| input | output | load | rigA tok/s | rigB tok/s |")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_compare_warns_on_mixed_precision_or_sampling_and_rejects_foreign_files(tmp_path):
    a = tmp_path / "a.json"
    run_bench(FakeServer(Script(ttft=0.005, itl=0.002)), a, "--label", "x")
    run = load_run(a)
    other = json.loads(json.dumps(run))
    other["label"] = "y"
    other["server"]["precision_before"] = {"weights": "float32"}
    assert not any("WARNING" in n for n in compare_runs([run, json.loads(json.dumps(run))]).notes)
    assert any("mixes precisions" in n for n in compare_runs([run, other]).notes)
    assert "mixes precisions" in to_markdown(compare_runs([run, other]))
    sampled = json.loads(json.dumps(run))
    sampled["sampling"] = "temperature=1.0,top_k=40"
    notes = compare_runs([run, sampled]).notes
    assert any("WARNING: the runs sample differently (greedy, temperature=1.0,top_k=40)" in n for n in notes)
    assert any(n.startswith("x #2: ") and "sampling temperature=1.0,top_k=40" in n for n in notes)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"completed": 3}))
    result = runner.invoke(app, ["bench", "compare", str(a), str(foreign)])
    assert result.exit_code != 0 and "not a gemmax bench result" in result.output


def test_ttft_in_tables_is_the_json_lines_median_over_every_request():
    """Three rounds of three concurrent requests whose round medians (10, 10, 100 ms) have a median
    (10) other than the median over all nine requests (100): the run table, the comparison and the
    JSON line all give 100, with the rounds' 10-100 beside it."""
    cfg = SweepConfig(base_url="http://unused", input_lens=(8,), output_len=4, repeats=3, concurrency=(3,))
    rounds = [[RequestRecord(8, 4, success=True, ttft=ms / 1000, latency=ms / 1000 + 0.03, itl=[0.01] * 3,
                             counted_tokens=4) for ms in times]
              for times in ((10, 10, 100), (10, 10, 100), (100, 100, 100))]
    cell = summarize_cell(cfg, 8, 3, None, "stream", [], rounds, duration=1.0)
    assert cell["ttft"]["median"] == pytest.approx(10.0) and cell["median_ttft_ms"] == pytest.approx(100.0)
    assert fmt_ttft(cell) == "100.0 (10.0-100.0)"
    result = {"label": "x", "model": "m", "decode_source": "stream", "prompt_mode": "ids", "cells": [cell]}
    console = Console(width=200, record=True)
    console.print(run_table(result))
    text = console.export_text()
    assert "100.0 (10.0-100.0)" in text and "median over every measured request" in text
    assert json.loads(summary_line(result))["cells"][0]["median_ttft_ms"] == pytest.approx(100.0)
    runs = [{**result, "label": label, "server": {"precision_before": None, "degenerate_responses_before": None,
                                                  "degenerate_responses_after": None}, "forced_output": True}
            for label in ("a", "b")]
    comparison = compare_runs(runs)
    assert comparison.rows[0][comparison.columns.index("a TTFT ms")] == "100.0 (10.0-100.0)"
    assert any("median over every measured request" in note for note in comparison.notes)


def test_decode_rate_is_one_over_the_tpot_column_at_any_concurrency():
    """Two rounds of two concurrent requests, one decoding at 10 ms a token and one at 30: each round's
    median rate would be the mean of 100 and 33.3 tok/s (66.7), while its median TPOT is 20 ms. The
    decode column (and the JSON line) is 1 / the TPOT column's median: 50 tok/s, rounds 50-50; the
    gauge column is the median of every request's gauge."""
    cfg = SweepConfig(base_url="http://unused", input_lens=(8,), output_len=11, repeats=2, concurrency=(2,))

    def record(itl: float) -> RequestRecord:
        return RequestRecord(8, 11, success=True, ttft=0.05, latency=0.05 + 10 * itl, itl=[itl] * 10,
                             counted_tokens=11, usage={"decode_tokens_per_second": 1 / itl})

    rounds = [[record(0.01), record(0.03)], [record(0.01), record(0.03)]]
    cell = summarize_cell(cfg, 8, 2, None, "both", [], rounds, duration=1.0)
    assert cell["median_tpot_ms"] == pytest.approx(20.0)
    assert cell["decode_tok_s"] == pytest.approx(1000 / cell["median_tpot_ms"]) == cell["stream"]["median"]
    assert cell["stream"]["min"] == cell["stream"]["max"] == pytest.approx(50.0)
    assert cell["stream"]["round_median"] == pytest.approx(50.0) and cell["stream"]["spread"] == 0
    assert cell["gauge"]["median"] == pytest.approx((100 + 100 / 3) / 2)  # median of 100, 33.3, 100, 33.3
    assert fmt_range(cell["stream"]) == "50.0 (50.0-50.0)"
    result = {"label": "x", "model": "m", "decode_source": "both", "prompt_mode": "ids", "cells": [cell]}
    assert json.loads(summary_line(result))["cells"][0]["decode_tok_s"] == pytest.approx(50.0)
    console = Console(width=250, record=True)
    console.print(run_table(result))
    assert "decode tok/s (wire) = 1 / TPOT ms" in console.export_text()
