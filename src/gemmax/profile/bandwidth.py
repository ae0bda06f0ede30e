"""Peak memory bandwidth: the spec sheet of a known device, else measured on this machine.

The roofline of decode is `tokens/s <= batch x bandwidth / bytes read per step`; its bandwidth is
the device's peak read bandwidth. For the accelerators below it comes from the vendor's spec sheet
(GB/s = 1e9 B/s); another GPU reports its own in the trace (the CUPTI tracer's memory clock x bus
width); a CPU is measured in the same run with every core reading
(`gemmax.engine.memory.measure_read_bandwidth`). The report says which it used.
"""

from __future__ import annotations

import dataclasses
import re

# (pattern on the JAX device_kind, lower-cased; GB/s; the part it means). First match wins, so the
# specific variants come before the family name.
KNOWN_DEVICES: tuple[tuple[str, float, str], ...] = (
    (r"\bt4g\b", 320.0, "NVIDIA T4G (GDDR6)"),
    (r"\bt4\b", 320.0, "NVIDIA T4 (GDDR6)"),
    (r"\bl4\b", 300.0, "NVIDIA L4 (GDDR6)"),
    (r"\ba10g\b", 600.0, "NVIDIA A10G (GDDR6)"),
    (r"\ba100\b.*80gb.*pcie|\ba100\b.*pcie.*80gb", 1935.0, "NVIDIA A100 80GB PCIe (HBM2e)"),
    (r"\ba100\b.*80gb", 2039.0, "NVIDIA A100 80GB SXM (HBM2e)"),
    (r"\ba100\b", 1555.0, "NVIDIA A100 40GB (HBM2)"),
    (r"\bh100\b.*nvl", 3900.0, "NVIDIA H100 NVL (HBM3)"),
    (r"\bh100\b.*pcie", 2000.0, "NVIDIA H100 PCIe (HBM2e)"),
    (r"\bh100\b", 3350.0, "NVIDIA H100 SXM (HBM3)"),
    (r"\bh200\b", 4800.0, "NVIDIA H200 (HBM3e)"),
    (r"tpu v5 ?lite|tpu v5e", 819.0, "TPU v5e (HBM2e)"),
    (r"tpu v6 ?lite|tpu v6e", 1640.0, "TPU v6e (HBM)"),
)


@dataclasses.dataclass(frozen=True)
class PeakBandwidth:
    gbs: float  # GB/s (1e9 bytes per second)
    source: str  # "spec: NVIDIA L4 (GDDR6)", "measured: 2 threads reading 512 MiB", "given: --peak-bandwidth"


def spec_bandwidth(device_kind: str) -> PeakBandwidth | None:
    """The spec-sheet read bandwidth of a known device kind ("NVIDIA L4", "TPU v5 lite"), else None."""
    kind = device_kind.lower()
    for pattern, gbs, part in KNOWN_DEVICES:
        if re.search(pattern, kind):
            return PeakBandwidth(gbs, f"spec: {part}")
    return None


def peak_bandwidth(device_kind: str, platform: str, given_gbs: float | None = None,
                   reported_bytes_per_s: float | None = None, measure_mib: int = 512) -> PeakBandwidth | None:
    """In order: a user-given figure, the spec of a known device, the figure the device reported in
    the trace (GPUs: memory clock x bus width), or on CPU the all-core read bandwidth measured now.
    None for an unknown accelerator that reports nothing (host memory says nothing about it)."""
    if given_gbs is not None:
        if given_gbs <= 0:
            raise ValueError(f"peak bandwidth must be > 0 GB/s, got {given_gbs}")
        return PeakBandwidth(given_gbs, "given: --peak-bandwidth")
    spec = spec_bandwidth(device_kind)
    if spec is not None:
        return spec
    if reported_bytes_per_s:
        return PeakBandwidth(reported_bytes_per_s / 1e9, "device: reported in the trace (memory clock x bus width)")
    if platform != "cpu":
        return None
    import os

    from gemmax.engine.memory import measure_read_bandwidth

    threads = os.cpu_count() or 1
    gbs = measure_read_bandwidth(size_mib=measure_mib, repeats=7, threads=threads)
    return PeakBandwidth(gbs, f"measured: {threads} threads reading {measure_mib} MiB (median of 7 passes)")
