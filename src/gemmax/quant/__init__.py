"""Load-time quantisation (docs/quantization.md): stored forms of a weight behind the protocol that
`gemmax.model.linear` calls (`gemmax.model.stored.StoredWeight`), one module per form, the options,
the device plan and the byte tables.

- `options`: `QuantOptions` (what a deployment asks for), `W4Tiles`, `QuantError`, the mode names.
- `int8`: `Int8Weight` (per output channel; also the int8 LM head) and its CPU kernels.
- `w4a16`: `Int4Weight` (group-wise int4) and its kernels, the Pallas one in `pallas_w4a16`.
- `table`: `QuantizedTable` (8/4-bit per-layer embedding, gathered by row).
- `packing`, `rounding`, `cpu`: the 4-bit layouts, the quantisers' rounding, the XLA:CPU
  matrix-vector spelling shared by the int8 and int4 forms.
- `plan`: the loader's `Quantizer`, `resolve` (kernels for the live device), the weight byte tables.

The names below are the package's public surface.
"""

from gemmax.model.stored import StoredWeight, is_quantized
from gemmax.quant.int8 import Int8Weight, gemm_copy_bytes, quantize_int8, tiled
from gemmax.quant.options import KERNELS, PLE_BITS, QUANT_MODES, QuantError, QuantOptions, W4Tiles
from gemmax.quant.packing import int4_group, packing_chunks
from gemmax.quant.plan import (
    BYTES_TABLE,
    Quantizer,
    QuantPlan,
    format_weight_bytes,
    quantize_params,
    quantized_weight_bytes,
    resolve,
    weight_bytes_table,
)
from gemmax.quant.rounding import grouped
from gemmax.quant.table import QuantizedTable, quantize_table
from gemmax.quant.w4a16 import Int4Weight, quantize_int4

__all__ = [
    "BYTES_TABLE", "KERNELS", "PLE_BITS", "QUANT_MODES", "Int4Weight", "Int8Weight", "QuantError", "QuantOptions",
    "QuantPlan", "QuantizedTable", "Quantizer", "StoredWeight", "W4Tiles", "format_weight_bytes", "grouped",
    "gemm_copy_bytes", "int4_group", "is_quantized", "packing_chunks", "quantize_int4", "quantize_int8", "quantize_params",
    "quantize_table", "quantized_weight_bytes", "resolve", "tiled", "weight_bytes_table",
]
