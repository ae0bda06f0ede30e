"""`gemmax fit --mesh` / `--table`: per-device bytes from the sharding rules, and refusals with the arithmetic."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from gemmax.cli import app
from gemmax.engine.memory import ACCELERATORS, MemoryPlanError, check_fit, plan_memory, smallest_mesh
from gemmax.engine.mesh import MeshSpec
from gemmax.model.config import FAMILY_TEXT_CONFIGS, ModelConfig
from gemmax.model.kv_cache import layer_cache_bytes

BF16 = dict(weight_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, activation_dtype=jnp.bfloat16, prefill_tokens=2048)
G31B = ModelConfig.from_hf_config(FAMILY_TEXT_CONFIGS["31B"])


def test_per_device_bytes_follow_the_sharding_rules():
    one = plan_memory(G31B, 8192, 8, 80 * 10**9, **BF16)
    tp2 = plan_memory(G31B, 8192, 8, 80 * 10**9, mesh=MeshSpec(tp=2), **BF16)
    dp2 = plan_memory(G31B, 8192, 8, 80 * 10**9, mesh=MeshSpec(dp=2), **BF16)
    # tp halves every split matrix; norms (and nothing else) stay whole on each device
    assert one.weights / 2 < tp2.weights < one.weights / 2 * 1.001
    assert dp2.weights == one.weights and dp2.kv_cache * 2 == one.kv_cache  # dp: all weights, half the slots
    # tp=8: 16 KV heads split 8 ways on sliding layers, 4 global KV heads cannot: full layers stay whole
    tp8 = plan_memory(G31B, 8192, 8, 80 * 10**9, mesh=MeshSpec(tp=8), **BF16)
    per_layer = layer_cache_bytes(G31B, 8192, 8, jnp.bfloat16)
    expected = sum(size // (8 if spec.num_kv_heads % 8 == 0 else 1) for size, spec in zip(per_layer, G31B.layers, strict=True))
    assert tp8.kv_cache == expected and any(spec.num_kv_heads == 4 for spec in G31B.layers)


def test_a_mesh_that_does_not_fit_is_refused_with_the_per_device_arithmetic():
    plan = plan_memory(G31B, 8192, 8, 40 * 10**9, mesh=MeshSpec(tp=2), **BF16)
    with pytest.raises(MemoryPlanError) as err:
        check_fit(plan)
    text = str(err.value)
    assert "mesh dp=1,tp=2 (2 devices), per device (DOES NOT FIT)" in text and "short by" in text


def test_smallest_mesh_is_the_fewest_devices_that_fit():
    for memory in (ACCELERATORS["T4 16GB"], ACCELERATORS["H100 80GB"]):
        plan = smallest_mesh(G31B, memory, model="31B", **BF16)
        assert plan is not None and plan.fits and plan.largest_batch >= 8
        devices = int(plan.mesh.split("(")[1].split()[0]) if "(" in plan.mesh else 1
        half = [plan_memory(G31B, 8192, 8, memory, mesh=MeshSpec(tp=devices // 2), **BF16)] if devices > 1 else []
        assert not any(p.fits for p in half), f"{plan.mesh} is not the smallest"


def test_fit_cli_mesh_flag_and_refusal():
    runner = CliRunner()
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(FAMILY_TEXT_CONFIGS["31B"]))
        ok = runner.invoke(app, ["fit", "--model", d, "--mesh", "dp=1,tp=4", "--max-model-len", "8192",
                                 "--device-memory-gib", "74", "--dtype", "bfloat16", "--kv-dtype", "bfloat16"])
        assert ok.exit_code == 0, ok.output
        assert "mesh dp=1,tp=4 (4 devices), per device (fits)" in ok.output
        refused = runner.invoke(app, ["fit", "--model", d, "--mesh", "dp=1,tp=2", "--max-model-len", "8192",
                                      "--device-memory-gib", "20", "--dtype", "bfloat16", "--kv-dtype", "bfloat16"])
        assert refused.exit_code == 1 and "DOES NOT FIT" in refused.output and "short by" in refused.output
        bad = runner.invoke(app, ["fit", "--model", d, "--mesh", "dp=x"])
        assert bad.exit_code != 0
