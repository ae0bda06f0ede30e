"""Rig registry and the vLLM command line (the fake and the real vLLM run in tests/test_rigs_vllm.py)."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from typer.testing import CliRunner

from gemmax.cli import app
from gemmax.rigs.registry import RIGS, RigOptions, get_rig
from gemmax.rigs.vllm import (
    KV_FLOOR_BYTES,
    SERVER_MODULE,
    VllmSettings,
    cpu_kv_cache_bytes,
    vllm_available,
    vllm_command,
    vllm_python,
)

runner = CliRunner()


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_carries_the_same_settings():
    argv = vllm_command(VllmSettings(model="google/gemma-4-E2B-it", port=8123, dtype="bfloat16", max_model_len=4096,
                                     max_num_seqs=4, served_model_name="gemma", api_key="k",
                                     extra_args=("--enforce-eager",)))
    assert argv[:5] == ["python", "-m", SERVER_MODULE, "--model", "google/gemma-4-E2B-it"]
    assert flag(argv, "--port") == "8123" and flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--dtype") == "bfloat16" and flag(argv, "--max-model-len") == "4096"
    assert flag(argv, "--max-num-seqs") == "4" and flag(argv, "--served-model-name") == "gemma"
    assert flag(argv, "--api-key") == "k" and flag(argv, "--seed") == "0"
    assert "--no-enable-prefix-caching" in argv and argv[-1] == "--enforce-eager"
    with pytest.raises(ValueError, match="dtype"):
        VllmSettings(model="m", dtype="int3")


def test_rig_vllm_cli_dry_run():
    result = runner.invoke(app, ["rig", "vllm", "--model", "/models/g4", "--port", "8200", "--max-model-len", "2048",
                                 "--max-num-seqs", "2", "--dry-run", "--enforce-eager"])
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.strip())
    settings = VllmSettings(model="/models/g4", port=8200, max_model_len=2048, max_num_seqs=2,
                            extra_args=("--enforce-eager",))
    assert argv == vllm_command(settings, python=vllm_python() or "python")


@pytest.mark.parametrize("name", ["g4_shared", "g3_small"])
def test_vllm_cpu_kv_budget_holds_the_cache_the_sequences_need(hf_checkpoints, name, tmp_path):
    """On CPU the rig gives vLLM an explicit KV budget for max_model_len x max_num_seqs tokens (a fixed
    memory fraction left -0.13 GiB of KV for the E2B-shaped checkpoint and vLLM refused to start): at
    least the cache gemmax itself allocates for the same model, lengths and dtype."""
    import jax.numpy as jnp

    from gemmax.engine.memory import kv_cache_bytes
    from gemmax.model.config import ModelConfig

    directory, _ = hf_checkpoints[name]
    config = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    # lengths where the budget is past KV_FLOOR_BYTES for these tiny models (the floor would hold anything)
    for max_len, seqs, dtype, jdtype in ((65536, 64, "bfloat16", jnp.bfloat16), (32768, 32, "float32", jnp.float32)):
        budget = cpu_kv_cache_bytes(str(directory), max_len, seqs, dtype)
        assert budget >= kv_cache_bytes(config, max_len, seqs, jdtype) and budget > KV_FLOOR_BYTES
        vllm = get_rig("vllm").command(RigOptions(model=str(directory), port=8301, dtype=dtype,
                                                  max_model_len=max_len, max_batch=seqs))
        assert int(flag(vllm, "--kv-cache-memory-bytes")) == budget
    if name == "g4_shared":  # the older Gemma 4 config form: no per_layer_config, no global_head_dim (512)
        hf = json.loads((directory / "config.json").read_text())
        hf.pop("per_layer_config")
        hf.pop("global_head_dim", None)
        (tmp_path / "config.json").write_text(json.dumps(hf))
        config = ModelConfig.from_hf_config(hf)
        assert cpu_kv_cache_bytes(str(tmp_path), 65536, 64) >= kv_cache_bytes(config, 65536, 64, jnp.bfloat16)
    assert cpu_kv_cache_bytes("google/gemma-4-E2B-it", 4096, 8) is None  # not a local directory: vLLM sizes it
    assert "--kv-cache-memory-bytes" not in get_rig("vllm").command(RigOptions(model="/nowhere", port=8302))


def test_registry_lists_and_builds_every_rig():
    assert set(RIGS) == {"gemmax", "transformers", "vllm"}
    options = RigOptions(model="/ckpt", port=8300, dtype="float32", max_model_len=128, max_batch=2)
    gemmax = get_rig("gemmax").command(options)
    assert gemmax[:4] == [sys.executable, "-m", "gemmax.cli", "serve"]
    assert flag(gemmax, "--max-model-len") == "128" and flag(gemmax, "--max-batch") == "2"
    hf = get_rig("transformers").command(options)
    assert hf[3:5] == ["rig", "transformers"] and flag(hf, "--dtype") == "float32" and flag(hf, "--port") == "8300"
    vllm = get_rig("vllm").command(options)
    assert flag(vllm, "--max-num-seqs") == "2" and flag(vllm, "--dtype") == "float32"
    assert get_rig("transformers").available() is True
    with pytest.raises(ValueError, match="unknown rig"):
        get_rig("llamacpp")
    if vllm_available() is None:
        with pytest.raises(RuntimeError, match=f"-m {SERVER_MODULE} --model /ckpt"):
            get_rig("vllm").start(options)


def test_rig_list_cli():
    result = runner.invoke(app, ["rig", "list", "--json"])
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(rows) == set(RIGS) and rows["vllm"]["available"] == (vllm_available() is not None)
