"""From options to quantised params: the loader's transform (`Quantizer`), the plan that picks each
form's kernel for the live device (`resolve`), and the weight bytes of each option set (`gemmax fit`).

Each tensor is quantised as it is read (`Quantizer.transform`), so peak host memory stays near the
quantised size; under `jax.eval_shape` the same code gives exact byte counts from shapes alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.model.params import abstract_params, count_bytes, map_params
from gemmax.quant.int8 import quantize_int8
from gemmax.quant.options import KERNELS, QuantError, QuantOptions
from gemmax.quant.pallas_w4a16 import W4A16FitError, check_w4a16_fits, describe_fit, onchip_limit
from gemmax.quant.table import quantize_table
from gemmax.quant.w4a16 import quantize_int4


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """The loader's `transform(spec, value)` and the step after loading (`finish`), for one option set
    (resolve them for the device with `resolve`; unresolved "auto" means the XLA form `kernel`)."""

    options: QuantOptions
    kernel: str = "xla"  # the device's XLA form ("cpu" on CPU): int8, and w4a16 when not resolved to another
    ple_group: int = 0  # hidden_size_per_layer_input: one scale per token per layer of the PLE table

    @classmethod
    def for_config(cls, options: QuantOptions, config, kernel: str = "xla") -> Quantizer:
        return cls(options, kernel, config.hidden_size_per_layer_input)

    def transform(self, spec, value: jax.Array) -> Any:
        o = self.options
        if spec.kind == "matrix" and o.quant == "int8":
            return quantize_int8(value, self.kernel, gemm_copy=o.int8_gemm_copy)
        if spec.kind == "matrix" and o.quant == "w4a16":
            if o.w4a16_kernel == "pallas" and o.w4a16_tiles is None:
                raise QuantError("w4a16_kernel='pallas' needs tiles for the device: pass the options through resolve()")
            kernel = self.kernel if o.w4a16_kernel == "auto" else o.w4a16_kernel
            return quantize_int4(value, kernel, o.w4a16_tiles)
        if spec.path == ("ple_embed",) and o.ple_bits != 16:
            return quantize_table(value, o.ple_bits, self.ple_group)
        return value

    def finish(self, params: dict[str, Any]) -> dict[str, Any]:
        """Add what is not a transform of one tensor: the int8 LM head (a copy of the tied embedding)."""
        if self.options.int8_lm_head:
            return {**params, "lm_head": quantize_int8(params["embed"], self.kernel)}
        return params


def quantize_params(params: dict[str, Any], config, options: QuantOptions, kernel: str = "xla") -> dict[str, Any]:
    """Quantise loaded params (arrays, or ShapeDtypeStructs under `jax.eval_shape`)."""
    quantizer = Quantizer.for_config(options, config, kernel)
    return quantizer.finish(map_params(params, config, quantizer.transform))


# ------------------------------------------------------------------------------------------- device plan


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """Options with concrete kernels for one device, and what the log should say about them."""

    options: QuantOptions
    kernel: str  # the XLA form for this platform: "cpu" or "xla"
    note: str | None = None  # the W4A16 tile arithmetic, or why the XLA path was chosen

    def quantizer(self, config) -> Quantizer:
        return Quantizer.for_config(self.options, config, self.kernel)


def resolve(options: QuantOptions, platform: str, compute_capability: str | None = None, config=None,
            probe: Callable | None = None) -> QuantPlan:
    """Choose the kernels for the live device. W4A16 on GPU/TPU uses the Pallas kernel with tiles that
    fit the on-chip memory per block (explicit tiles that do not fit are refused with the arithmetic)
    and, given `probe` (tiles, chunk shapes -> gemmax.engine.kernel_probe.ProbeResult, run on the live
    device), only once the probe compiled it and matched the XLA path: else "auto" falls back to XLA
    and an explicit "pallas" is refused ("auto" also falls back when the probe timed it slower than
    XLA); on CPU the measured XLA form, or the Pallas kernel in interpret mode only when explicitly
    allowed."""
    if options.quant == "auto":
        raise QuantError("quant='auto' depends on the checkpoint: resolve it with QuantOptions.for_source first")
    kernel = "cpu" if platform == "cpu" else "xla"
    if options.quant != "w4a16":
        return QuantPlan(options, kernel)
    asked, tiles = options.w4a16_kernel, options.w4a16_tiles
    if asked in KERNELS and asked != "pallas":  # already resolved
        return QuantPlan(options, kernel)
    if asked == "xla" or (platform == "cpu" and asked == "auto"):
        return QuantPlan(dataclasses.replace(options, w4a16_kernel="cpu" if asked == "auto" else "xla"), kernel)
    if config is None:
        raise QuantError("the W4A16 Pallas kernel needs the model config to check its tiles")
    if platform == "cpu":
        if not options.allow_pallas_interpret:
            raise QuantError(
                "--w4a16-kernel pallas on CPU runs Pallas in interpret mode (pallas_interpret=True), a simulator "
                "thousands of times slower than the XLA path: refusing to serve with it; pass "
                "--allow-pallas-interpret to run it anyway (tests, debugging)")
        fit = check_w4a16_fits(config, tiles, device_limit=1 << 62, platform="cpu")
        return QuantPlan(dataclasses.replace(options, w4a16_kernel="pallas_interpret", w4a16_tiles=fit.tiles),
                         kernel, "Pallas W4A16 kernel in interpret mode (simulated on CPU)")
    limit = onchip_limit(platform, compute_capability)
    try:
        fit = check_w4a16_fits(config, tiles, limit, platform=platform)
    except W4A16FitError as exc:
        if asked == "auto" and tiles is None:
            return QuantPlan(dataclasses.replace(options, w4a16_kernel="xla"), kernel,
                             f"no Pallas tiling fits, using the XLA W4A16 path: {exc}")
        raise
    note = describe_fit(fit)
    if probe is not None:
        result = probe(fit.tiles, tuple(b.shape for b in fit.blocks))
        slower = result.ok and result.speedup is not None and result.speedup < 1
        options = dataclasses.replace(options, w4a16_probe="failed" if not result.ok else "slower" if slower else "passed")
        if slower and asked == "auto":
            return QuantPlan(dataclasses.replace(options, w4a16_kernel="xla"), kernel,
                             f"the Pallas W4A16 kernel passed its start-up probe but ran at {result.speedup:.2f}x the "
                             f"XLA path's speed, using the XLA W4A16 path (--w4a16-kernel pallas forces it): {result.detail}")
        if not result.ok and asked == "auto":
            return QuantPlan(dataclasses.replace(options, w4a16_kernel="xla"), kernel,
                             f"the Pallas W4A16 kernel failed its start-up probe on this device, using the XLA "
                             f"W4A16 path: {result.detail}")
        if not result.ok:
            raise QuantError(f"--w4a16-kernel pallas: the kernel failed its start-up probe on this device: {result.detail}")
        note += f"; start-up probe passed: {result.detail}"
    return QuantPlan(dataclasses.replace(options, w4a16_kernel="pallas", w4a16_tiles=fit.tiles), kernel, note)


# ------------------------------------------------------------------------------------------- bytes

# The option sets `gemmax fit` lists (weights only: the KV cache option does not change them).
BYTES_TABLE = {
    "none": QuantOptions(),
    "int8": QuantOptions(quant="int8"),
    "w4a16": QuantOptions(quant="w4a16"),
    "ple8": QuantOptions(ple_bits=8),
    "ple4": QuantOptions(ple_bits=4),
    "int8_lm_head": QuantOptions(int8_lm_head=True),
    "ple4+int8_lm_head": QuantOptions(ple_bits=4, int8_lm_head=True),
    "int8+ple4+int8_lm_head": QuantOptions(quant="int8", ple_bits=4, int8_lm_head=True),
    "w4a16+ple4+int8_lm_head": QuantOptions(quant="w4a16", ple_bits=4, int8_lm_head=True),
}


def quantized_weight_bytes(config, options: QuantOptions, weight_dtype: Any = jnp.bfloat16, kernel: str = "xla") -> int:
    """Exact bytes of the params a load with `options` keeps on a device whose XLA form is `kernel`
    ("cpu" keeps int8 matrices' GEMM copies), from shapes alone (`jax.eval_shape`)."""
    shapes = jax.eval_shape(lambda p: quantize_params(p, config, options, kernel), abstract_params(config, weight_dtype))
    return count_bytes(shapes)


def weight_bytes_table(config, weight_dtype: Any = jnp.bfloat16, kernel: str = "xla",
                       int8_gemm_copy: bool = True) -> dict[str, int]:
    """{option label: weight bytes} for the option sets of BYTES_TABLE (PLE options only with a PLE table)
    on a device whose XLA form is `kernel`, int8 layers with or without their CPU GEMM copies."""
    return {label: quantized_weight_bytes(config, dataclasses.replace(options, int8_gemm_copy=int8_gemm_copy),
                                          weight_dtype, kernel)
            for label, options in BYTES_TABLE.items()
            if options.ple_bits == 16 or config.hidden_size_per_layer_input}


def format_weight_bytes(table: dict[str, int], weight_dtype: Any = jnp.bfloat16) -> str:
    base = table["none"]
    lines = [f"weight bytes by quantisation option ({jnp.dtype(weight_dtype).name} otherwise, norms float32):"]
    for label, n in table.items():
        lines.append(f"  {label:26s} {n:>16,} B  {n / (1 << 30):7.3f} GiB  {n / base:6.1%}")
    return "\n".join(lines)
