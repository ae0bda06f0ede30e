"""`gemmax profile`: where the time of a decode step goes, and how far it is from the bandwidth roofline.

- `run.profile_decode` traces decode steps of the engine's `decode_step` with the JAX profiler;
- `trace.op_times` reads the per-op device time out of the trace;
- `hlo.Classifier` says what each op is from the compiled HLO (conversion, fp32 / 16-bit matmul, ...);
- `bandwidth.peak_bandwidth` gives the roofline's bandwidth (device spec or measured);
- `report` renders one run, or several side by side, from the JSON the run writes.
"""

from gemmax.profile.report import load, table, top_ops_table
from gemmax.profile.run import profile_decode

__all__ = ["load", "profile_decode", "table", "top_ops_table"]
