"""What a deployment asks of load-time quantisation: one frozen `QuantOptions` (with the W4A16 tiles
it may name) and its error.

The options travel from the CLI through `gemmax.engine.loading.load_model` into the loader's
`transform` hook (gemmax.quant.plan), which quantises each tensor as it is read; docs/quantization.md
describes each option and what it costs.
"""

from __future__ import annotations

import dataclasses

QUANT_MODES = ("auto", "none", "int8", "w4a16")
PLE_BITS = (16, 8, 4)
KV_CACHE_DTYPES = ("auto", "int8")
W4A16_KERNELS = ("auto", "xla", "pallas")  # what a user asks for; resolved to one of KERNELS
KERNELS = ("xla", "cpu", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class W4Tiles:
    """Block of the W4A16 kernel: bm rows of x, bn output columns, bk input columns per K step; `stages`
    buffers of the streamed tiles (2: double-buffered, as Triton and the TPU pipeline do)."""

    bm: int
    bn: int
    bk: int
    stages: int = 2

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}x{self.stages}"

    @classmethod
    def parse(cls, text: str) -> W4Tiles:
        """'BMxBNxBK' or 'BMxBNxBKxSTAGES', e.g. '16x512x2048x2'."""
        try:
            parts = [int(p) for p in text.lower().split("x")]
            if len(parts) not in (3, 4) or min(parts) < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"tiles must look like BMxBNxBK[xSTAGES] with positive integers, got {text!r}") from None
        return cls(*parts)


class QuantError(ValueError):
    """Quantisation options that cannot run as asked (with the reason)."""


@dataclasses.dataclass(frozen=True)
class QuantOptions:
    """Load-time quantisation of one deployment (docs/quantization.md)."""

    # linear layers: none | int8 (per output channel) | w4a16 (int4, group-wise scales) | auto
    # (`for_source`: int8 layers and LM head for weights that were already stored quantised)
    quant: str = "none"
    ple_bits: int = 16  # per-layer embedding table: 16 (as loaded) | 8 | 4
    int8_lm_head: bool = False  # an int8 copy of the tied embedding for the LM head's matmul
    # CPU, quant int8: each layer matrix also held in bf16 for 8+ rows (batched decode, prefill): faster
    # batched steps and prefill for 2 more bytes a weight (gemmax.quant.int8)
    int8_gemm_copy: bool = True
    kv_cache: str = "auto"  # auto (device policy) | int8 (per-position, per-head scales)
    w4a16_kernel: str = "auto"  # auto | xla | pallas; after `resolve`: one of KERNELS
    w4a16_tiles: W4Tiles | None = None  # Pallas tiles (None: the largest that fits)
    allow_pallas_interpret: bool = False  # run the Pallas kernel in CPU interpret mode (a simulator)
    w4a16_probe: str | None = None  # after `resolve` on a live GPU / TPU: "passed" | "slower" | "failed" (engine.kernel_probe)

    def __post_init__(self):
        for name, value, allowed in (("quant", self.quant, QUANT_MODES), ("ple_bits", self.ple_bits, PLE_BITS),
                                     ("kv_cache", self.kv_cache, KV_CACHE_DTYPES),
                                     ("w4a16_kernel", self.w4a16_kernel, W4A16_KERNELS + KERNELS)):
            if value not in allowed:
                raise QuantError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")

    def for_source(self, quantized_source: bool, dtype_given: bool) -> QuantOptions:
        """Resolve quant="auto" for one checkpoint. A checkpoint whose matrices were already stored at 8
        bits or fewer (a Q4_K_M / Q8_0 GGUF, the built-in model) keeps them as int8 (layers and the LM
        head), as llama.cpp runs such files quantised: batch-1 decode streams half the bytes of bf16
        (docs/real_model.md has the measured speed and the quality cost). Anything else, or an
        explicit `--dtype` (which asks for the dequantised weights at that dtype), loads unquantised."""
        if self.quant != "auto":
            return self
        if quantized_source and not dtype_given:
            return dataclasses.replace(self, quant="int8", int8_lm_head=True)
        return dataclasses.replace(self, quant="none")

    @property
    def changes_weights(self) -> bool:
        return self.quant != "none" or self.ple_bits != 16 or self.int8_lm_head

    @property
    def label(self) -> str:
        """Short name, e.g. 'int8+ple4+int8_lm_head' ('none' when nothing is quantised)."""
        parts = [self.quant] if self.quant != "none" else []
        parts += [f"ple{self.ple_bits}"] if self.ple_bits != 16 else []
        parts += ["int8_lm_head"] if self.int8_lm_head else []
        parts += ["kv_int8"] if self.kv_cache == "int8" else []
        return "+".join(parts) or "none"

    def describe(self) -> str:
        """The policy line's part: what is quantised and how it runs."""
        text = f"quant={self.quant} ple_bits={self.ple_bits} int8_lm_head={self.int8_lm_head}"
        if self.quant == "w4a16":
            text += f" w4a16_kernel={self.w4a16_kernel}"
            if self.w4a16_tiles is not None:
                text += f" w4a16_tiles={self.w4a16_tiles}"
            if self.w4a16_probe is not None:
                text += f" w4a16_probe={self.w4a16_probe}"
        return text
