"""Device check: the live device policy plus real matrix products checked against numpy.

The products run through `gemmax.model.linear.linear`, the function every weight read of the model goes
through, with the policy's dtypes (activations x weights), at one row (the decode matrix-vector
spelling) and at eight rows (the batched / prefill spelling). The reference is numpy in float64 on
the same rounded inputs (`linear` rounds x to the weight dtype before the product), so the only
error left is accumulation and output rounding; a broken
driver or a miscompiled kernel shows as a large error, an overflow as non-finite output.
`large_sums` feeds positive inputs whose dot products reach ~1.3e5, past float16's largest finite
value (65504): it fails exactly where activations are float16, the overflow Gemma's wide residual
stream hits on pre-Ampere GPUs.

Run as `python -m gemmax.mcp.device [--dtype D]`, it prints the report as one JSON line. The MCP
server runs it that way, in a short-lived process, so the server itself never initialises an
accelerator (JAX preallocates most of a GPU's memory in the first process that touches it).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pydantic import BaseModel, Field

# Largest error allowed, relative to max |reference|, by the coarser of the weight dtype (the one-row
# product is computed in it) and the activation dtype (the output): a few units of its rounding
# (bf16 2^-8, f16 2^-11) plus float32 accumulation over K = 512 terms.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}
IN_FEATURES, OUT_FEATURES = 512, 256


class MatmulCheck(BaseModel):
    name: str
    shape: str = Field(description="x [rows, in] @ W [out, in].T")
    dtypes: str = Field(description="activations x weights")
    max_abs_reference: float
    max_rel_error: float | None = Field(description="max |y - ref| / max |ref|; null when y has non-finite values")
    tolerance: float
    finite: bool
    ok: bool
    note: str | None = None


class DeviceReport(BaseModel):
    """The live device, the dtype policy chosen for it, and whether real products come out right."""

    platform: str
    device_kind: str
    compute_capability: str | None
    device_memory_bytes: int | None
    device_count: int
    jax_version: str
    policy: dict[str, Any] = Field(description="the full device policy (gemmax.engine.policy)")
    warning: str | None = Field(description="the policy's warning, e.g. an emulated dtype")
    checks: list[MatmulCheck]
    ok: bool = Field(description="every check within tolerance and finite")


def _inputs(name: str, rows: int, rng) -> tuple[Any, Any]:
    import numpy as np

    if name == "large_sums":
        x = rng.uniform(500.0, 1500.0, (rows, IN_FEATURES))  # every product positive: sums ~1.3e5
        w = rng.uniform(0.0, 0.5, (OUT_FEATURES, IN_FEATURES))
    else:
        x = rng.standard_normal((rows, IN_FEATURES))
        w = rng.standard_normal((OUT_FEATURES, IN_FEATURES)) / np.sqrt(IN_FEATURES)
    return x, w


def matmul_check(name: str, rows: int, activations: str, weights: str, seed: int = 0) -> MatmulCheck:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemmax.engine.policy import DTYPES
    from gemmax.model.linear import linear

    x, w = _inputs(name, rows, np.random.default_rng(seed))
    xd, wd = jnp.asarray(x, DTYPES[activations]), jnp.asarray(w, DTYPES[weights])
    y = np.asarray(jax.jit(linear)(xd, wd), np.float64)  # [rows, out]
    ref = np.asarray(xd.astype(wd.dtype), np.float64) @ np.asarray(wd, np.float64).T
    scale = float(np.abs(ref).max())
    finite = bool(np.isfinite(y).all())
    rel = float(np.abs(y - ref).max() / scale) if finite else None
    tolerance = max(TOLERANCE[activations], TOLERANCE[weights])
    note = None
    if not finite:
        limit = float(jnp.finfo(DTYPES[activations]).max)
        note = (f"non-finite output: |reference| reaches {scale:.3g}, beyond {activations}'s largest value "
                f"{limit:.6g}" if scale > limit else "non-finite output from finite inputs: the device computes wrong")
    elif rel > tolerance:
        note = f"error {rel:.3g} above tolerance {tolerance:g}: the device's product disagrees with numpy"
    return MatmulCheck(name=name, shape=f"[{rows}, {IN_FEATURES}] @ [{OUT_FEATURES}, {IN_FEATURES}].T",
                       dtypes=f"{activations} x {weights}", max_abs_reference=scale, max_rel_error=rel,
                       tolerance=tolerance, finite=finite, ok=finite and rel is not None and rel <= tolerance,
                       note=note)


def verify_device(dtype: str = "auto") -> DeviceReport:
    import jax

    from gemmax.engine.policy import device_policy

    policy = device_policy(dtype)
    checks = [matmul_check(name, rows, policy.activations, policy.weights)
              for name, rows in (("decode_row", 1), ("batch_rows", 8), ("large_sums", 8))]
    return DeviceReport(platform=policy.platform, device_kind=policy.device_kind,
                        compute_capability=policy.compute_capability, device_memory_bytes=policy.device_memory_bytes,
                        device_count=jax.device_count(), jax_version=jax.__version__, policy=policy.as_dict(),
                        warning=policy.warning, checks=checks, ok=all(c.ok for c in checks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", help="auto (device policy), float32, bfloat16, float16")
    args = parser.parse_args(argv)
    try:
        report = verify_device(args.dtype)
    except ValueError as exc:  # an unknown --dtype
        print(str(exc), file=sys.stderr)
        return 2
    print(report.model_dump_json())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
