"""`gemmax profile --prefill T`: where one prefill chunk's time goes, set against the device's compute peak.

A prefill chunk multiplies T tokens by every weight matrix: compute-bound where decode is
bandwidth-bound, so its roofline is FLOP/s, not GB/s. The run compiles the engine's own
`prefill_step` for one chunk of T tokens into one slot after `context` cached tokens, as the last
chunk of its prompt (so the LM head runs, as on the chunk that gives TTFT; the first token's
sampling is a program of its own, `draw`, not timed here), times it untraced and traces
it like the decode step (`run._measure`): the same op categories.

- FLOPs per chunk are counted on the step's own jaxpr (`dot_flops`): every `dot_general` (the
  weight matmuls, attention's q.k and p.v, the LM head), a scan's body times its length, a
  conditional's costliest branch (the head sits in one on the last chunk, model.forward's `head_on`,
  which this chunk takes); elementwise work is not counted (the usual convention of model FLOPs).
  XLA's `cost_analysis` is not used: it counts a loop's body once, and the int8 prefill GEMM is a
  loop over weight tiles.
- The compute peak is measured in the same run: a plain `dot_general` in the policy's compute dtype
  with f32 accumulation (how `model.linear` multiplies several rows) at the chunk's own shapes (the
  MLP's up and down projections at M = T: what a GEMM of this T reaches) and at one large square
  shape; the best of them is the peak. A chunk far below the GEMM rate at its own shapes loses its
  time outside the matmuls; one near it is as fast as this T allows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmax.engine.steps import init_device_state, prefill_step
from gemmax.model.config import ModelConfig
from gemmax.model.forward import Precision
from gemmax.model.params import Params

SQUARE = 2048  # the large GEMM of the peak: [2048, 2048] x [2048, 2048]
FLOPS_NOTE = ("2 x m x n x k of every dot_general in the step's jaxpr (weight matmuls, attention, the LM head; "
              "scans times their length); elementwise work not counted")


@dataclasses.dataclass(frozen=True)
class GemmRate:
    m: int
    k: int
    n: int
    dtype: str
    gflops: float  # 2 m k n / median seconds, 1e9 FLOP/s

    @property
    def label(self) -> str:
        return f"{self.m}x{self.k}x{self.n} {self.dtype}"


def gemm_rate(m: int, k: int, n: int, dtype: Any, repeats: int = 7) -> GemmRate:
    """The median rate of [m, k] x [k, n] in `dtype` with f32 accumulation, on the default device."""
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                   preferred_element_type=jnp.float32))
    jax.block_until_ready(dot(a, b))
    # As many products per timing as make it last ~20 ms, so a small shape is not all dispatch.
    started = time.perf_counter()
    jax.block_until_ready(dot(a, b))
    inner = max(1, int(0.02 / max(time.perf_counter() - started, 1e-6)))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = [dot(a, b) for _ in range(inner)]
        jax.block_until_ready(out)
        seconds.append((time.perf_counter() - started) / inner)
    return GemmRate(m, k, n, jnp.dtype(dtype).name, 2 * m * k * n / float(np.median(seconds)) / 1e9)


def gemm_rates(config: ModelConfig, tokens: int, dtype: Any) -> list[GemmRate]:
    """The chunk's own MLP shapes at M = tokens (up: hidden -> intermediate, down: back), then the
    large square."""
    h, i = config.hidden_size, config.layers[0].intermediate_size
    return [gemm_rate(tokens, h, i, dtype), gemm_rate(tokens, i, h, dtype), gemm_rate(SQUARE, SQUARE, SQUARE, dtype)]


def prefill_executable(params: Params, config: ModelConfig, tokens: int, context: int, precision: Precision,
                       kv_len: tuple[int, ...]):
    """The compiled `prefill_step` of one chunk [1, tokens] (all real) into slot 0 after `context`
    cached tokens, as the prompt's last chunk, the function that runs it n times back to back (each
    run rewrites the same positions, so every run does the same work) and its FLOPs (`dot_flops`).
    `kv_len`: the KV bounds, as the engine compiles its chunks (`shapes.kv_buckets`), so the chunk
    reads the past the engine's would: none at context 0, else the first bound that holds it."""
    device = init_device_state(config, 1, context + tokens, precision)
    ids = jnp.full((1, tokens), config.bos_token_id, jnp.int32)
    args = (ids, jnp.int32(0), jnp.int32(context), jnp.int32(tokens), jnp.bool_(True))
    statics = {"config": config, "precision": precision, "kv_len": kv_len}
    compiled = prefill_step.lower(params, device, *args, **statics).compile()
    flops = dot_flops(jax.make_jaxpr(functools.partial(prefill_step, **statics))(params, device, *args))
    state = {"device": device}

    def run(n: int) -> None:
        device = state["device"]
        for _ in range(n):
            device, _ = compiled(params, device, *args)
        state["device"] = device
        jax.block_until_ready(device.tokens)

    return compiled, run, flops


def dot_flops(jaxpr) -> float:
    """2 x (output elements) x (contracted size) summed over the `dot_general`s of a (closed) jaxpr,
    into every sub-jaxpr: a scan's body times its length, a conditional's costliest branch, a while
    loop's body once (its trip count is not static)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in lhs_contract)
        elif name == "cond":
            total += max(dot_flops(branch) for branch in eqn.params["branches"])
        else:
            inner = sum(dot_flops(v) for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr"))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def compute_block(flops: float | None, host_step_s: float, tokens: int, rates: list[GemmRate]) -> dict[str, Any]:
    """The report's compute figures: FLOPs, achieved rate, the measured GEMM rates and the shares."""
    achieved = flops / host_step_s / 1e9 if flops else None
    peak = max(rates, key=lambda r: r.gflops)
    own = max(rates[:-1], key=lambda r: r.gflops) if len(rates) > 1 else peak  # the chunk's own shapes
    return {
        "tokens": tokens,
        "tokens_per_second": tokens / host_step_s,
        "flops_per_chunk": flops,
        "flops_note": FLOPS_NOTE,
        "achieved_gflops": achieved,
        "gemm_rates": [dataclasses.asdict(r) | {"label": r.label} for r in rates],
        "peak_gflops": peak.gflops,
        "peak_source": f"measured: best GEMM of this run ({peak.label})",
        "own_shape_gflops": own.gflops,
        "own_shape_source": f"measured: the faster MLP GEMM at M = {tokens} ({own.label})",
        "peak_percent": 100 * achieved / peak.gflops if achieved else None,
        "own_shape_percent": 100 * achieved / own.gflops if achieved else None,
    }
