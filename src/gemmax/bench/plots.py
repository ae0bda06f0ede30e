"""PNG plots across rigs: wire decode tok/s and TTFT against input length, one line per rig and load
level (matplotlib, Agg backend; imported only when a plot is asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_runs(runs: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gemmax.bench.report import load_level

    fig, (ax_decode, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        levels: dict[str, list[dict[str, Any]]] = {}
        for cell in run["cells"]:
            levels.setdefault(load_level(cell), []).append(cell)
        for level, cells in levels.items():
            cells = sorted((c for c in cells if c["stream"]), key=lambda c: c["input_len"])
            if not cells:
                continue
            xs = [c["input_len"] for c in cells]
            label = f"{run['label']} ({level})" if len(levels) > 1 else run["label"]
            ax_decode.errorbar(xs, [c["stream"]["median"] for c in cells], marker="o", capsize=3, label=label,
                               yerr=[[c["stream"]["median"] - c["stream"]["min"] for c in cells],
                                     [c["stream"]["max"] - c["stream"]["median"] for c in cells]])
            ttft = [c["median_ttft_ms"] for c in cells]  # over every request; bars: the rounds' medians (`fmt_ttft`)
            ax_ttft.errorbar(xs, ttft, marker="o", capsize=3, label=label,
                             yerr=[[max(0.0, t - c["ttft"]["min"]) for t, c in zip(ttft, cells, strict=True)],
                                   [max(0.0, c["ttft"]["max"] - t) for t, c in zip(ttft, cells, strict=True)]])
    ax_decode.set(xlabel="input tokens", ylabel="decode tok/s (wire, 1/TPOT)", title="Decode rate")
    ax_ttft.set(xlabel="input tokens", ylabel="TTFT ms", title="Time to first token")
    ax_ttft.set_yscale("log")
    for ax in (ax_decode, ax_ttft):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
