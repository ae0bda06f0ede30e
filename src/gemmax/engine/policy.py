"""Device policy: read the live device once and choose the dtypes the engine computes in.

float16 below SM 8.0 (no bf16 datapath: bf16 would be emulated through fp32), bfloat16 at SM 8.0 and
above and on TPU. On CPU, weights are stored in bfloat16 and activations kept in float32: the
`(x.astype(bf16) @ W.T)` form streams bf16 weights at near memory bandwidth (docs/cpu_decode.md),
which is the fastest decode measured here. The policy is the engine's first log line and is served
as data by `/health`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.model import Precision

log = logging.getLogger("gemmax")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class DevicePolicy:
    platform: str  # cpu | gpu | tpu
    device_kind: str
    compute_capability: str | None  # "8.9" on CUDA GPUs
    device_memory_bytes: int | None
    compute_dtype: str  # the dtype matmuls run in
    weights: str
    activations: str
    kv_cache: str
    pallas_interpret: bool
    override: str | None = None  # --dtype given by the user
    warning: str | None = None  # set when the override picks an emulated path

    @property
    def pre_ampere(self) -> bool:
        return self.platform == "gpu" and self.compute_capability is not None and float(self.compute_capability) < 8.0

    def precision(self) -> Precision:
        return Precision(activation=DTYPES[self.activations], kv_cache=DTYPES[self.kv_cache])

    @property
    def weight_dtype(self) -> Any:
        return DTYPES[self.weights]

    def log_line(self) -> str:
        cc = self.compute_capability or "n/a"
        return (
            f"gemmax device policy: platform={self.platform} kind={self.device_kind} compute_capability={cc} "
            f"compute_dtype={self.compute_dtype} weights={self.weights} activations={self.activations} "
            f"kv_cache={self.kv_cache} pallas_interpret={self.pallas_interpret}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pre_ampere": self.pre_ampere}


def _device_facts() -> tuple[str, str, str | None, int | None]:
    device = jax.devices()[0]
    platform = device.platform
    kind = getattr(device, "device_kind", platform)
    cc = getattr(device, "compute_capability", None)
    memory = None
    try:
        stats = device.memory_stats() or {}
        memory = stats.get("bytes_limit")
    except Exception:  # CPU devices report no memory stats
        memory = None
    if memory is None and platform == "cpu":
        import os

        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return platform, kind, (str(cc) if cc is not None else None), memory


def device_policy(dtype: str | None = None) -> DevicePolicy:
    """The policy for the live device; `dtype` ('auto' or None, float32, bfloat16, float16) overrides it."""
    platform, kind, cc, memory = _device_facts()
    if platform == "gpu" and cc is not None and float(cc) < 8.0:
        auto = ("float16", "float16", "float16")  # compute, weights, activations
    elif platform in ("gpu", "tpu"):
        auto = ("bfloat16", "bfloat16", "bfloat16")
    else:
        auto = ("bfloat16", "bfloat16", "float32")
    override = None if dtype in (None, "auto") else dtype
    if override is not None and override not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    warning = None
    if override is None:
        compute, weights, activations = auto
    else:
        compute = weights = override
        activations = "float32" if (platform == "cpu" and override != "float32") else override
        if platform == "gpu" and cc is not None and float(cc) < 8.0 and override == "bfloat16":
            warning = (f"--dtype bfloat16 on SM {cc}: this GPU has no bf16 datapath, every bf16 op is emulated "
                       "through fp32 and decode will be several times slower; the policy would pick float16")
        elif platform == "cpu" and override == "float16":
            warning = "--dtype float16 on CPU: XLA:CPU has no fast float16 matmul; decode is emulated and slow"
    return DevicePolicy(
        platform=platform, device_kind=kind, compute_capability=cc, device_memory_bytes=memory,
        compute_dtype=compute, weights=weights, activations=activations, kv_cache=activations,
        pallas_interpret=platform == "cpu", override=override, warning=warning,
    )
