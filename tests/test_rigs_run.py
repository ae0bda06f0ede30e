"""benchmarks/rigs_run.py's sampled table: every sampled figure is divided by the greedy figure measured
just before it (the entry's `greedy_cells`), not by the rig's main greedy sweep of minutes earlier;
results written before `greedy_cells` existed still read against the main sweep."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rigs_run  # noqa: E402


def cell(input_len: int, concurrency: int, decode_tok_s: float, output_tok_s: float) -> dict:
    return {"input_len": input_len, "concurrency": concurrency, "stream": {"median": decode_tok_s},
            "output_throughput": output_tok_s}


def rows(run: dict) -> list[list[str]]:
    lines = rigs_run.sampled_table([run])
    return [[field.strip() for field in line.strip("|").split("|")] for line in lines[2:]]


def test_sampled_figures_are_divided_by_the_greedy_sweep_just_before_them():
    run = {"label": "gemmax", "cells": [cell(41, 1, 60.0, 50.0), cell(41, 8, 200.0, 180.0)],  # main sweep
           "sampled": [{"sampling": "temperature=1.0", "cells": [cell(41, 1, 27.0, 25.0), cell(41, 8, 90.0, 80.0)],
                        "greedy_cells": [cell(41, 1, 30.0, 28.0), cell(41, 8, 100.0, 95.0)]},
                       {"sampling": "top_k=40", "cells": [cell(41, 1, 45.0, 40.0)],
                        "greedy_cells": [cell(41, 1, 50.0, 45.0)]}]}
    assert rows(run) == [
        ["gemmax", "temperature=1.0", "41", "27.0", "30.0", "0.90", "80.0", "95.0", "0.84"],
        ["gemmax", "top_k=40", "41", "45.0", "50.0", "0.90", "", "", ""],
    ]


def test_results_without_adjacent_greedy_read_against_the_main_sweep():
    run = {"label": "vllm", "cells": [cell(41, 1, 20.0, 18.0)],
           "sampled": [{"sampling": "min_p=0.05", "cells": [cell(41, 1, 18.0, 16.0)]}]}
    assert rows(run) == [["vllm", "min_p=0.05", "41", "18.0", "20.0", "0.90", "", "", ""]]


def test_each_sampled_setting_follows_its_own_greedy_sweep(monkeypatch, tmp_path):
    """bench_rig's order of sweeps: the main greedy sweep, then for every setting a greedy sweep and the
    sampled one at the sampled inputs; each result entry keeps the greedy cells measured before it.
    (The rig, its health and the quality check are stand-ins here: the sweeps themselves run against
    real servers in tests/test_bench_e2e.py and benchmarks/rigs_run.py.)"""
    from argparse import Namespace
    from types import SimpleNamespace

    class Process:
        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    rig = SimpleNamespace(prepare=None, command=lambda options: ["rig"], start=lambda options, **_: Process())
    monkeypatch.setattr(rigs_run, "get_rig", lambda name: rig)
    monkeypatch.setattr(rigs_run, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(rigs_run, "quality_check", lambda url, reference: {
        "agree_prefix": 4, "tokens": 4, "prompt_ids_match": True, "degenerate": False, "judged_degenerate": False,
        "text": "ok"})
    sweeps = []

    def sweep_levels(url, name, args, input_lens, sampling):
        sweeps.append((input_lens, rigs_run.sampling_name(sampling)))
        return {"cells": [f"cells {len(sweeps)}"]}

    monkeypatch.setattr(rigs_run, "sweep_levels", sweep_levels)
    samplings = tuple(rigs_run.parse_sampling(text) for text in ("temperature=1.0", "top_k=40"))
    args = Namespace(dtype="bfloat16", max_model_len=256, concurrency=(1, 8), out_dir=tmp_path, startup_timeout=5,
                     input_lens=(41, 521), sampled_input_lens=(41,), sampling=samplings)
    result = rigs_run.bench_rig("builtin", tmp_path, "gemmax", args, reference=None)
    greedy = rigs_run.sampling_name(())
    assert sweeps == [((41, 521), greedy), ((41,), greedy), ((41,), "temperature=1.0"), ((41,), greedy),
                      ((41,), "top_k=40")]
    assert [(part["greedy_cells"], part["cells"]) for part in result["sampled"]] == [
        (["cells 2"], ["cells 3"]), (["cells 4"], ["cells 5"])]


def test_sweep_levels_measures_every_concurrency_and_keeps_the_last_servers_state():
    """Every `--concurrency` level is swept (not only 1 and 8), each with its own repeats; the merged
    result's degenerate-response counter is the server's after the last level, its delta over all of
    them, and each level's config stays under `parts`."""
    from argparse import Namespace

    from bench_fake_server import FakeServer, Script

    server = FakeServer(Script(ttft=0.002, itl=0.001), degenerate_every=1)  # every completion counted degenerate
    args = Namespace(concurrency=(4, 1, 2), repeats=2, repeats_batched=1, output_len=3)
    with server.in_thread():
        result = rigs_run.sweep_levels(server.base_url, "fake", args, (8,), ())
    assert [c["concurrency"] for c in result["cells"]] == [1, 2, 4]
    assert [len(c["requests"]) for c in result["cells"]] == [2, 2, 4]
    assert [(p["concurrency"], p["config"]["repeats"]) for p in result["parts"]] == [(1, 2), (2, 1), (4, 1)]
    assert result["config"]["concurrency"] == [1, 2, 4]
    served = len(server.served)  # probes, warm-ups and measured requests of the three sweeps
    assert served == 3 + (1 + 2) + (2 + 2) + (4 + 4)
    server_state = result["server"]
    assert server_state["degenerate_responses_before"] == 0
    assert server_state["degenerate_responses_after"] == server_state["degenerate_responses_delta"] == served
