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
