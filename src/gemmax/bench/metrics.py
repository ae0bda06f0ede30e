"""Summaries of request records: `vllm bench serve`'s per-run metrics under its own names, plus the
figures this harness adds (decode rates by source, gauge resolution against run-to-run spread)."""

from __future__ import annotations

import decimal
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from gemmax.bench.timing import RequestRecord

PERCENTILES = (90, 99)


def vllm_metrics(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """The fields `vllm bench serve --save-result` writes, over `records` that took `duration` s.

    Failed requests count in `failed` and `errors`, with output length 0 (as vLLM does)."""
    ok = [r for r in records if r.success]
    output_lens = [r.output_tokens if r.success else 0 for r in records]
    input_lens = [r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in records]
    total_input = sum(n for n, r in zip(input_lens, records, strict=True) if r.success)
    total_output = sum(output_lens)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": total_output / duration if duration > 0 else None,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else None,
    }
    for name, values in series.items():
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        empty = ms.size == 0
        out[f"mean_{name}_ms"] = None if empty else float(ms.mean())
        out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
        out[f"std_{name}_ms"] = None if empty else float(ms.std())
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    out.update({
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "errors": [r.error for r in records],
    })
    return out


def spread_stats(values: Sequence[float]) -> dict[str, Any] | None:
    """Median with min / max and the relative spread (max - min) / median; None when empty."""
    if not values:
        return None
    med = statistics.median(values)
    return {
        "median": med, "min": min(values), "max": max(values), "n": len(values),
        "spread": (max(values) - min(values)) / med if med else None,
        "values": list(values),
    }


def tick_of(value: float) -> float:
    """The resolution a number was sent with: 12.8 -> 0.1, 13 -> 1, 12.8341 -> 0.0001.

    Python's float repr is the shortest string that round-trips, so a gauge rounded to one decimal by
    the server reads back with one decimal here; a JSON integer has a tick of 1."""
    if isinstance(value, int):
        return 1.0
    exponent = decimal.Decimal(repr(float(value))).as_tuple().exponent
    return 10.0 ** min(exponent, 0) if isinstance(exponent, int) else 0.0


def gauge_resolution(gauges: Sequence[float], stream_spread: float | None) -> dict[str, Any]:
    """Resolution of a server gauge (finest tick seen / median value) against run-to-run spread.

    `flagged` is True when the tick is coarser than the spread the wire measured: repeats that
    print "12.8, 12.8, 12.8" then say nothing about stability."""
    tick = min(tick_of(g) for g in gauges)
    med = statistics.median(gauges)
    resolution = tick / med if med else None
    flagged = None
    if resolution is not None and stream_spread is not None and len(gauges) >= 2:
        flagged = resolution > stream_spread
    return {"tick": tick, "resolution": resolution, "spread": stream_spread, "flagged": flagged}
