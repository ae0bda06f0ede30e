"""Device policy: the live CPU's choice (bf16 weights only while XLA fuses the bf16 matrix-vector
product), the GPU rules by compute capability, loud warnings for emulated overrides, and the dtypes
reported from the arrays actually loaded."""

from __future__ import annotations

import json
import logging

import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from gemmax.cli import app
from gemmax.engine.policy import choose_policy, cpu_gemv_fuses, device_policy, log_policy
from gemmax.model.config import E2B_TEXT_CONFIG, ModelConfig
from gemmax.model.kv_cache import init_cache
from gemmax.model.params import random_params


def test_live_cpu_policy():
    p = device_policy()
    assert p.platform == "cpu" and p.device_memory_bytes > 2**30
    # jax is pinned to a version whose XLA:CPU fuses the bf16 matrix-vector product (docs/cpu_decode.md).
    assert p.cpu_gemv_fusion is True and cpu_gemv_fuses("bfloat16")
    assert (p.compute_dtype, p.weights, p.activations, p.kv_cache) == ("bfloat16", "bfloat16", "float32", "bfloat16")
    assert p.warning is None and p.override is None
    line = p.log_line()
    assert line.startswith("gemmax device policy: platform=cpu kind=")
    assert "compute_dtype=bfloat16 weights=bfloat16 activations=float32 kv_cache=bfloat16" in line
    assert p.precision().activation == jnp.float32
    # prefill chunks of at most 512 tokens on CPU (cheaper per token there than 2048: policy.py), one of
    # 64 for short prompts; batched prefill only of 4 or more prompts in one chunk of 32
    assert p.prefill_buckets == (32, 64, 128, 512) and p.as_dict()["prefill_buckets"] == [32, 64, 128, 512]
    assert (p.prefill_batched_buckets, p.prefill_batched_min_rows) == ((32,), 4)
    assert p.as_dict()["prefill_batched_buckets"] == [32] and p.as_dict()["prefill_batched_min_rows"] == 4


def test_gpu_rules_by_compute_capability():
    turing = choose_policy("gpu", "Tesla T4", "7.5", 15 * 2**30)
    assert (turing.compute_dtype, turing.weights, turing.kv_cache) == ("float16", "float16", "float16")
    assert turing.pre_ampere and turing.warning is None
    assert turing.log_line() == (
        "gemmax device policy: platform=gpu kind=Tesla T4 compute_capability=7.5 compute_dtype=float16 "
        "weights=float16 activations=float16 kv_cache=float16 pallas_interpret=False"
    )
    ada = choose_policy("gpu", "NVIDIA L4", "8.9", 22 * 2**30)
    assert (ada.compute_dtype, ada.weights, ada.kv_cache) == ("bfloat16", "bfloat16", "bfloat16")
    assert not ada.pre_ampere and ada.cpu_gemv_fusion is None
    assert ada.prefill_buckets == (32, 128, 512, 2048)
    ampere = choose_policy("gpu", "NVIDIA A100", "8.0", 80 * 2**30)
    assert ampere.compute_dtype == "bfloat16"
    tpu = choose_policy("tpu", "TPU v5 lite", None, 16 * 2**30)
    assert tpu.compute_dtype == "bfloat16" and tpu.warning is None


def test_emulated_overrides_warn_loudly():
    forced = choose_policy("gpu", "Tesla T4", "7.5", 1, dtype="bfloat16")
    assert forced.weights == "bfloat16" and forced.override == "bfloat16"
    assert "EMULATED" in forced.warning and "7.5" in forced.warning and "float16" in forced.warning
    assert "EMULATED" in choose_policy("cpu", "cpu", None, 1, dtype="float16", cpu_gemv_fusion=True).warning
    assert "EMULATED" in choose_policy("tpu", "TPU", None, 1, dtype="float16").warning
    # Not emulated: no warning.
    assert choose_policy("gpu", "NVIDIA L4", "8.9", 1, dtype="float16").warning is None
    assert choose_policy("cpu", "cpu", None, 1, dtype="float32", cpu_gemv_fusion=True).warning is None
    with pytest.raises(ValueError, match="unknown dtype"):
        choose_policy("cpu", "cpu", None, 1, dtype="int8")


def test_cpu_without_the_fusion_falls_back_to_float32():
    p = choose_policy("cpu", "cpu", None, 1, cpu_gemv_fusion=False)
    assert p.weights == "float32" and "does not fuse" in p.warning
    assert "does not fuse" in choose_policy("cpu", "cpu", None, 1, dtype="bfloat16", cpu_gemv_fusion=False).warning


def test_observed_reports_the_dtypes_in_use(caplog):
    config = ModelConfig.from_hf_config({
        **E2B_TEXT_CONFIG, "vocab_size": 64, "vocab_size_per_layer_input": 64,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "layer_types": None,
        "num_kv_shared_layers": 0, "head_dim": 8, "global_head_dim": 16, "hidden_size_per_layer_input": 4,
    })
    p = device_policy()
    params = random_params(config, weight_dtype=jnp.float16)
    seen = p.observed(params, init_cache(config, 1, 8, jnp.bfloat16))
    assert (seen.weights, seen.kv_cache) == ("float16", "bfloat16")
    assert seen.as_dict()["weights"] == "float16"
    assert p.observed(params, init_cache(config, 1, 8, jnp.int8)).kv_cache == "int8"  # not its float32 scales
    with caplog.at_level(logging.INFO, logger="gemmax"):
        log_policy(choose_policy("gpu", "Tesla T4", "7.5", 1, dtype="bfloat16"))
    assert caplog.records[0].getMessage().startswith("gemmax device policy: platform=gpu")
    assert caplog.records[1].levelno == logging.WARNING and "EMULATED" in caplog.records[1].getMessage()


def test_policy_cli():
    result = CliRunner().invoke(app, ["policy", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["platform"] == "cpu" and data["weights"] == "bfloat16" and data["cpu_gemv_fusion"] is True
