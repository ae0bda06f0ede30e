"""The W4A16 Pallas kernel is chosen on a GPU / TPU only after its start-up probe (gemmax.engine.kernel_probe)
compiled it, matched the XLA path and was not slower; otherwise gemmax uses XLA and the policy line says why.
On CPU the probe runs the kernel in interpret mode (the compiled mode is what the device check runs on a GPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

import gemmax.quant as Q
from gemmax.engine.kernel_probe import ProbeResult, live_probe, probe_shapes, probe_w4a16
from gemmax.model.config import E2B_SIX_LAYER_CONFIG, ModelConfig
from gemmax.model.params import random_params
from gemmax.quant import w4a16
from gemmax.quant.pallas_w4a16 import W4Tiles, check_w4a16_fits, effective_tiles

SMALL = ModelConfig.from_hf_config(dict(
    E2B_SIX_LAYER_CONFIG, vocab_size=256, vocab_size_per_layer_input=256, hidden_size=128, intermediate_size=256,
    num_attention_heads=2, head_dim=32, global_head_dim=64, hidden_size_per_layer_input=16, sliding_window=64))
W4 = Q.QuantOptions(quant="w4a16")


def interpreted(tiles, chunks):
    return probe_w4a16(tiles, chunks, interpret=True)


def test_probe_covers_every_block_shape_the_model_uses():
    e2b = ModelConfig.from_hf_config(E2B_SIX_LAYER_CONFIG)
    fit = check_w4a16_fits(e2b, None, 227 * 1024)
    chunks = tuple(b.shape for b in fit.blocks)
    shapes = probe_shapes(fit.tiles, chunks)
    # one (bn, K) per distinct block: the grid only repeats it
    assert {(n, k) for _, n, k in shapes} == {(effective_tiles(c, fit.tiles, Q.int4_group(c[1]))[0], c[1]) for c in chunks}
    assert all(m == fit.tiles.bm for m, _, _ in shapes) and len(shapes) < len(set(chunks))


def test_a_passing_probe_picks_pallas_and_says_so():
    plan = Q.resolve(W4, "gpu", "9.0", SMALL, probe=interpreted)
    assert plan.options.w4a16_kernel == "pallas" and plan.options.w4a16_probe == "passed"
    assert "w4a16_kernel=pallas" in plan.options.describe() and "w4a16_probe=passed" in plan.options.describe()
    assert "start-up probe passed: max error" in plan.note


def test_a_kernel_that_does_not_compile_falls_back_to_xla():
    compiled_on_cpu = lambda tiles, chunks: probe_w4a16(tiles, chunks, interpret=False)  # noqa: E731
    plan = Q.resolve(W4, "gpu", "9.0", SMALL, probe=compiled_on_cpu)  # Pallas compiles only in interpret mode on CPU
    assert plan.options.w4a16_kernel == "xla" and plan.options.w4a16_probe == "failed"
    assert "w4a16_probe=failed" in plan.options.describe() and "failed its start-up probe" in plan.note
    with pytest.raises(Q.QuantError, match="failed its start-up probe"):
        Q.resolve(dataclasses.replace(W4, w4a16_kernel="pallas"), "gpu", "9.0", SMALL, probe=compiled_on_cpu)


def test_a_wrong_kernel_fails_the_probe(monkeypatch):
    monkeypatch.setattr(w4a16, "w4a16_matmul", lambda x, packed, scales, **kw: jnp.zeros((x.shape[0], packed.shape[0])))
    probe_w4a16.cache_clear()
    try:
        # tiles and shape of no other test: jit caches the traced (here broken) kernel by them
        result = probe_w4a16(W4Tiles(4, 16, 256), ((48, 256),), interpret=True)
    finally:
        probe_w4a16.cache_clear()
    assert not result.ok and result.detail.startswith("wrong result: max error 1.0e+00")


def test_a_slower_kernel_is_not_the_default_but_can_be_forced():
    slower = lambda tiles, chunks: ProbeResult(True, "one row: Pallas 600 us, XLA 400 us", 400 / 600)  # noqa: E731
    plan = Q.resolve(W4, "gpu", "9.0", SMALL, probe=slower)
    assert plan.options.w4a16_kernel == "xla" and plan.options.w4a16_probe == "slower"
    assert "ran at 0.67x the XLA path's speed" in plan.note
    forced = Q.resolve(dataclasses.replace(W4, w4a16_kernel="pallas"), "gpu", "9.0", SMALL, probe=slower)
    assert forced.options.w4a16_kernel == "pallas" and forced.options.w4a16_probe == "slower"


def test_timed_probe_reports_a_speedup():
    result = probe_w4a16(W4Tiles(8, 32, 512), ((64, 512), (32, 1024)), interpret=True, timed=True)
    assert result.ok and result.speedup > 0 and "one row: Pallas" in result.detail


def test_live_probe_runs_only_on_accelerators():
    assert live_probe("cpu") is None and live_probe("gpu") is probe_w4a16 and live_probe("tpu") is probe_w4a16


def test_resolved_pallas_options_quantise(monkeypatch):
    """The options `resolve` returns for a GPU (kernel "pallas" with tiles) load: the H200 run found them refused."""
    plan = Q.resolve(W4, "gpu", "9.0", SMALL, probe=lambda t, c: ProbeResult(True, "ok"))
    params = Q.quantize_params(random_params(SMALL, 0, jnp.bfloat16), SMALL, plan.options, plan.kernel)
    layer = params["layers"][0]
    weights = [v for v in layer.values() if isinstance(v, Q.Int4Weight)]
    assert weights and {w.kernel for w in weights} == {"pallas"} and {w.tiles for w in weights} == {plan.options.w4a16_tiles}
