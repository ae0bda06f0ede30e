"""Device policy: read the live device once and choose the dtypes the engine computes in.

- GPU below SM 8.0 (Turing, Volta ...): float16. These GPUs have no bf16 datapath; bf16 would be
  emulated through fp32 and run several times slower.
- GPU at SM 8.0 and above, TPU: bfloat16 everywhere.
- CPU: weights and KV cache stored in bfloat16, activations in float32, matrix products with bf16
  inputs and f32 accumulation. XLA:CPU streams bf16 weights at near memory bandwidth, but only in
  one fused matrix-vector form (docs/cpu_decode.md: ~30-37 GB/s against 1-2 GB/s for the obvious
  spellings, and 2x fewer bytes than float32 weights at the same GB/s). Because that fusion is a
  heuristic of the installed XLA, the policy compiles a small probe and checks its HLO; if the
  fusion is missing it falls back to float32 weights (twice the bytes, but no 20x cliff) and warns.

`--dtype` overrides the automatic choice and warns loudly when it picks an emulated path (bf16 on a
pre-Ampere GPU, float16 on TPU, float16 on CPU where batched decode and prefill have no f16 GEMM).
The policy is the engine's first log line, and `as_dict` is what `/health` serves; `observed`
replaces the planned dtypes with the ones the loaded arrays actually have.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform as host_platform
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.engine.fastpath import GEMV, decode_weight_reads
from gemmax.model.forward import Precision
from gemmax.model.kv_cache import KVCache
from gemmax.model.linear import linear
from gemmax.quant.cpu import native_bf16

log = logging.getLogger("gemmax")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Prefill chunk lengths the engine compiles (engine.plan_chunks splits a prompt into them). On CPU a
# 2048-token chunk costs more per token than four of 512: a 2057-token prompt of the E2B-shaped model
# prefilled in 4.0 s as 2048 + 32 and in 3.1 s as 4 x 512 + 32 (same engine, interleaved runs).
# On CPU a 64-token chunk too: a 41-token prompt of the built-in model took 87-91 ms as 32 + 9 in two
# chunks and 71.5-74 ms as one of 64 (engine alone, medians of two runs each alternated, serve's shapes;
# benchmarks/results/bucket-64-2026-12-05.txt).
PREFILL_BUCKETS = (32, 128, 512, 2048)
CPU_PREFILL_BUCKETS = (32, 64, 128, 512)
# Batched prefill shapes (several prompts in one forward) on CPU: 4 or more prompts of one 32-token
# chunk only. Bursts into the engine, built-in model (last first token / mean TTFT;
# benchmarks/results/bucket-64-2026-12-05.txt): four 100-token prompts 438 / 436 ms as one batch of 4 x
# 128 (one run) and 446-482 / 282-295 ms one at a time; eight 41-token ones 506-516 / 502-512 ms as one
# batch of 8 in two 8 x 32 chunks and 530-551 / 297-312 ms one at a time in chunks of 64; two 20-token
# ones 86-88 / 86-87 ms as a batch of 2 and 92-95 / 70-72 ms one at a time. Our reading: a chunk of 128
# tokens per prompt already runs its GEMMs near the CPU's peak alone. Dropping the 2 x 32, 2 x 128 and 4
# x 128 shapes (and adding the 64 chunk program) took the warm-up from 10.6-10.9 to 9.0-10.1 s. Three
# prompts now go one at a time too (not measured).
CPU_PREFILL_BATCHED_BUCKETS = (32,)
CPU_PREFILL_BATCHED_MIN_ROWS = 4


@dataclasses.dataclass(frozen=True)
class DevicePolicy:
    platform: str  # cpu | gpu | tpu
    device_kind: str  # "NVIDIA L4"; on CPU the processor model and core count
    compute_capability: str | None  # "8.9" on CUDA GPUs
    device_memory_bytes: int | None
    compute_dtype: str  # the dtype matmul inputs are rounded to
    weights: str
    activations: str
    kv_cache: str
    pallas_interpret: bool
    cpu_gemv_fusion: bool | None = None  # CPU: XLA fuses the bf16 matrix-vector product (None elsewhere)
    # CPU: bf16 dot instructions (AVX512_BF16, AMX, Arm BF16); False: int8 GEMMs run in f32
    # (gemmax.quant.cpu.gemm_dtype). None elsewhere, or unknown.
    cpu_bf16_gemm: bool | None = None
    override: str | None = None  # --dtype given by the user
    warning: str | None = None  # set when the override (or the installed XLA) picks a slow path
    quant: Any = None  # gemmax.quant.QuantOptions in use (kernels resolved); set by runtime.load_model
    prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS  # the engine's default prefill chunk lengths
    prefill_batched_buckets: tuple[int, ...] | None = None  # those with batched prefill shapes (None: all)
    prefill_batched_min_rows: int | None = None  # the fewest prompts of such a shape (None: shapes.MIN_BATCHED_ROWS)

    @property
    def pre_ampere(self) -> bool:
        return self.platform == "gpu" and self.compute_capability is not None and float(self.compute_capability) < 8.0

    def precision(self) -> Precision:
        kv = jnp.int8 if self.kv_cache == "int8" else DTYPES[self.kv_cache]  # int8: per-position scales
        return Precision(activation=DTYPES[self.activations], kv_cache=kv)

    @property
    def weight_dtype(self) -> Any:
        return DTYPES[self.weights]

    def log_line(self) -> str:
        cc = self.compute_capability or "n/a"
        line = (
            f"gemmax device policy: platform={self.platform} kind={self.device_kind} compute_capability={cc} "
            f"compute_dtype={self.compute_dtype} weights={self.weights} activations={self.activations} "
            f"kv_cache={self.kv_cache} pallas_interpret={self.pallas_interpret}"
        )
        if self.cpu_gemv_fusion is not None:
            line += f" cpu_gemv_fusion={self.cpu_gemv_fusion}"
        if self.cpu_bf16_gemm is not None:
            line += f" cpu_bf16_gemm={'native' if self.cpu_bf16_gemm else 'emulated (int8 GEMMs in float32)'}"
        if self.quant is not None:
            line += f" {self.quant.describe()}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pre_ampere": self.pre_ampere, "prefill_buckets": list(self.prefill_buckets),
                "prefill_batched_buckets": None if self.prefill_batched_buckets is None else list(self.prefill_batched_buckets)}

    def observed(self, params: Any, kv_cache: KVCache | None = None) -> DevicePolicy:
        """This policy with `weights` / `kv_cache` read from the arrays actually loaded (matrix leaves;
        several dtypes, e.g. after quantisation, are joined with '+')."""
        weights = _dtype_names(leaf for leaf in jax.tree.leaves(params) if len(leaf.shape) >= 2)
        kv = "+".join(kv_cache.dtypes) if kv_cache is not None else ""  # a bf16 cache is stored as bits
        return dataclasses.replace(self, weights=weights or self.weights, kv_cache=kv or self.kv_cache)


def _dtype_names(leaves) -> str:
    return "+".join(sorted({jnp.dtype(leaf.dtype).name for leaf in leaves}))


def _cpu_kind() -> str:
    name = host_platform.processor() or host_platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} cores)"


def _device_facts() -> tuple[str, str, str | None, int | None]:
    device = jax.devices()[0]
    platform = device.platform
    kind = getattr(device, "device_kind", platform)
    cc = getattr(device, "compute_capability", None)
    memory = None
    try:
        memory = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # CPU devices report no memory stats
        memory = None
    if platform == "cpu":
        kind = _cpu_kind()
        if memory is None:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return platform, kind, (str(cc) if cc is not None else None), memory


@functools.cache
def cpu_gemv_fuses(weight_dtype: str = "bfloat16") -> bool:
    """Whether this XLA:CPU compiles `linear` at one row into the fused matrix-vector dot that streams
    `weight_dtype` weights directly (the fast-path audit run on the compiled HLO of a small probe, ~0.1 s)."""
    w = jax.ShapeDtypeStruct((512, 384), DTYPES[weight_dtype])
    x = jax.ShapeDtypeStruct((1, 1, 384), jnp.float32)
    text = jax.jit(linear).lower(x, w).compile().as_text()
    return set(decode_weight_reads(text).values()) == {(GEMV,)}


def device_policy(dtype: str | None = None) -> DevicePolicy:
    """The policy for the live device; `dtype` ('auto' or None, float32, bfloat16, float16) overrides it."""
    platform, kind, cc, memory = _device_facts()
    fused = cpu_gemv_fuses("bfloat16") if platform == "cpu" else None
    return choose_policy(platform, kind, cc, memory, dtype, cpu_gemv_fusion=fused,
                         cpu_bf16_gemm=native_bf16() if platform == "cpu" else None)


def choose_policy(
    platform: str,
    kind: str,
    compute_capability: str | None,
    memory: int | None,
    dtype: str | None = None,
    cpu_gemv_fusion: bool | None = None,
    cpu_bf16_gemm: bool | None = None,
) -> DevicePolicy:
    """The decision itself, from the device facts (`device_policy` reads them from the live device)."""
    override = None if dtype in (None, "auto") else dtype
    if override is not None and override not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    cc = compute_capability
    pre_ampere = platform == "gpu" and cc is not None and float(cc) < 8.0
    warning = None
    if platform == "cpu":
        fused = bool(cpu_gemv_fusion)
        if override is None:
            compute = weights = "bfloat16" if fused else "float32"
            if not fused:
                warning = (
                    "this XLA:CPU does not fuse the bf16 matrix-vector product (docs/cpu_decode.md): bf16 weights "
                    "would be converted to f32 on every decode step (~20x slower), so weights are float32 (2x the bytes)"
                )
        else:
            compute = weights = override
            if override == "float16":
                warning = (
                    "--dtype float16 on CPU is an EMULATED path for batched decode and prefill: XLA:CPU has no "
                    "float16 GEMM and converts the weights on every call (~1.3 GB/s against ~11 for bfloat16); "
                    "only batch-1 decode streams float16 as fast as bfloat16 (docs/cpu_decode.md)"
                )
            elif override == "bfloat16" and not fused:
                warning = ("--dtype bfloat16: this XLA:CPU does not fuse the bf16 matrix-vector product, decode "
                           "converts every weight on every step (~20x slower than float32)")
        # Activations stay float32 (norms, softmax, residual stream). The KV cache is bf16 with bf16
        # weights: measured 2-13% faster decode than float32 at 128 and 2000 tokens of context (fewer
        # bytes read and converted), at half the memory; float32 weights keep a float32 cache.
        activations = "float32"
        kv_cache = "float32" if weights == "float32" else "bfloat16"
    else:
        auto = "float16" if pre_ampere else "bfloat16"
        compute = weights = activations = kv_cache = override or auto
        if pre_ampere and override == "bfloat16":
            warning = (
                f"--dtype bfloat16 on SM {cc} is an EMULATED path: this GPU has no bf16 datapath, every bf16 op runs "
                "through fp32 and decode will be several times slower; the policy would pick float16"
            )
        elif platform == "tpu" and override == "float16":
            warning = "--dtype float16 on TPU is an EMULATED path: the MXU has no float16 mode; the policy would pick bfloat16"
    return DevicePolicy(
        platform=platform,
        device_kind=kind,
        compute_capability=cc,
        device_memory_bytes=memory,
        compute_dtype=compute,
        weights=weights,
        activations=activations,
        kv_cache=kv_cache,
        pallas_interpret=platform == "cpu",
        cpu_gemv_fusion=cpu_gemv_fusion if platform == "cpu" else None,
        cpu_bf16_gemm=cpu_bf16_gemm if platform == "cpu" else None,
        override=override,
        warning=warning,
        prefill_buckets=CPU_PREFILL_BUCKETS if platform == "cpu" else PREFILL_BUCKETS,
        prefill_batched_buckets=CPU_PREFILL_BATCHED_BUCKETS if platform == "cpu" else None,
        prefill_batched_min_rows=CPU_PREFILL_BATCHED_MIN_ROWS if platform == "cpu" else None,
    )


def log_policy(policy: DevicePolicy) -> None:
    """The engine's first log line, then the warning (if any) in capitals so nobody misses it."""
    log.info(policy.log_line())
    if policy.warning:
        log.warning("WARNING: %s", policy.warning)
