"""Per-op device time of one compiled module, read from a JAX profiler trace (`*.xplane.pb`).

The trace is read with `jax.profiler.ProfileData` (jaxlib's XSpace reader), no TensorFlow needed.
Every event XLA records for an op carries `hlo_op` (the instruction name) and `hlo_module` stats, and
`run_id` identifies one execution of the module (one decode step).

- GPU / TPU: the events of the `/device:*` planes (kernels on streams, or the TPU's "XLA Ops" line);
  an HLO op that launches several kernels gets their sum. Some TPU runtimes (a v5e with jax 0.10.2)
  record ops with no module stats, the instruction's text as the event's name (`%fusion.3 = ...`):
  their ops are the "XLA Ops" events inside the "XLA Modules" line's spans of the module, one span a
  run (`_ops_in_module_spans`).
- CPU: XLA:CPU runs ops on host threads, so the events come from the `/host:CPU` plane. A
  `conditional` or `while` op's event encloses the events of the ops in its body, so each event is
  charged its exclusive time (its duration minus the events nested in it on the same thread).

Per op, the time per step is the median over steps of its time in that step: one step stalled by
another process on a shared machine does not move the shares.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import statistics
from collections import defaultdict
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class OpTimes:
    """Time per step of each op of one module, from a trace."""

    per_op_ns: dict[str, float]  # op name -> median ns per step
    steps: int  # executions of the module seen in the trace
    step_span_ns: float  # median over steps of (last op end - first op start)
    source: str  # which plane the events came from
    memory_bandwidth: float | None = None  # bytes/s, as a GPU device plane reports it (memory_bandwidth stat)

    @property
    def total_ns(self) -> float:
        return sum(self.per_op_ns.values())


def find_xplane(trace_dir: str | Path) -> Path:
    """The newest `*.xplane.pb` under a `jax.profiler.trace` directory."""
    files = sorted(Path(trace_dir).glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}/plugins/profile: was the trace written?")
    return files[-1]


def _exclusive(events: list[tuple[int, int, dict]]) -> list[tuple[int, int, dict, int]]:
    """(start, end, stats) on one thread -> (start, end, stats, exclusive ns): nested events subtracted."""
    events = sorted(events, key=lambda e: (e[0], -e[1]))
    out: list[list] = []
    stack: list[int] = []  # indices into out of the events still open
    for start, end, stats in events:
        while stack and out[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            out[stack[-1]][3] -= min(end, out[stack[-1]][1]) - start
        out.append([start, end, stats, end - start])
        stack.append(len(out) - 1)
    return [tuple(e) for e in out]


_OP_TEXT = re.compile(r"(?:ROOT\s+)?%?([\w.\-]+) = ")  # "%copy-start.58 = (f32[512]...) copy-start(...)" -> copy-start.58


def _ops_in_module_spans(plane, module: str) -> list[tuple[int, int, dict]]:
    """(start, end, {"hlo_op", "run_id"}) of the "XLA Ops" events that run inside a span of `module` on
    the plane's "XLA Modules" line (named "jit_decode_step(14326850022379987117)"), for traces whose op
    events carry no module stats; [] when the plane has no such spans."""
    lines = {line.name: line for line in plane.lines}
    if "XLA Modules" not in lines or "XLA Ops" not in lines:
        return []
    spans = sorted((int(e.start_ns), int(e.end_ns), dict(e.stats).get("run_id", i))
                   for i, e in enumerate(lines["XLA Modules"].events) if e.name.startswith(module + "("))
    starts = [start for start, _, _ in spans]
    events = []
    for event in lines["XLA Ops"].events:
        start, end = int(event.start_ns), int(event.end_ns)
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and end <= spans[i][1]:
            match = _OP_TEXT.match(event.name)
            events.append((start, end, {"hlo_op": match.group(1) if match else event.name, "run_id": spans[i][2]}))
    return events


def op_times(xplane: str | Path, module: str, steps: int) -> OpTimes:
    """Per-op time per step of the HLO module named `module` (e.g. "jit_decode_step") over a trace of
    `steps` executions (used to split the time when the events carry no run id)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    device_lines, host_lines = [], []
    bandwidth = None
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            bandwidth = bandwidth or dict(plane.stats).get("memory_bandwidth")
        found = {}
        for line in plane.lines:
            events = []
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    events.append((int(event.start_ns), int(event.end_ns), stats))
            if events:
                found[line.name] = events
        if plane.name.startswith("/device:"):
            if not found and (spanned := _ops_in_module_spans(plane, module)):
                found["XLA Ops"] = spanned
            # A device plane with an "XLA Ops" line (TPU) holds the ops there; its other lines repeat them.
            device_lines += [found["XLA Ops"]] if "XLA Ops" in found else list(found.values())
        else:
            host_lines += list(found.values())
    lines, source = (device_lines, "device") if device_lines else (host_lines, "host")
    if not lines:
        raise ValueError(f"the trace {xplane} has no op events of module {module!r}")
    per_run: dict[object, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    spans: dict[object, list[int]] = {}
    for events in lines:
        for start, end, stats, exclusive in _exclusive(events):
            run = stats.get("run_id", 0)
            per_run[run][str(stats["hlo_op"])] += exclusive
            span = spans.setdefault(run, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
    runs = list(per_run.values())
    names = {name for run in runs for name in run}
    per_op = {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}
    span = statistics.median(end - start for start, end in spans.values())
    if len(runs) == 1 and steps > 1:  # no run ids (some device tracers): one bucket holding every step
        per_op = {name: value / steps for name, value in per_op.items()}
        span /= steps
    return OpTimes(per_op_ns=per_op, steps=len(runs) if len(runs) > 1 else steps, step_span_ns=span, source=source,
                   memory_bandwidth=float(bandwidth) if bandwidth else None)
