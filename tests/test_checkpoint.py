"""Config parsing and checkpoint loading: layouts, sharding, refusals, full-size E2B accounting."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gemmax.model.config import E2B_TEXT_CONFIG, ConfigError, ModelConfig
from gemmax.model.params import count_params, param_specs
from gemmax.weights.checkpoint import CheckpointError, build_params
from gemmax.weights.load import load_checkpoint

E2B_TEXT_PARAMS = 4_628_569_344  # spec §15, from a meta-device count of transformers' model


def _leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_config_matches_transformers_kv_sharing_and_geometry(hf_checkpoints):
    for name in ("g4_shared", "g4_k_eq_v"):
        directory, model = hf_checkpoints[name]
        config = ModelConfig.from_dir(directory)
        hf = model.config
        modes = [m or "own" for m in hf.kv_sharing_modes]
        assert [s.kv_mode for s in config.layers] == modes
        for i, spec in enumerate(config.layers):
            attn = model.model.layers[i].self_attn
            assert spec.head_dim == attn.head_dim
            assert (spec.kv_mode == "reuse") == attn.is_kv_shared_layer
            assert spec.intermediate_size == model.model.layers[i].mlp.gate_proj.out_features
            if spec.owns_kv:
                assert spec.num_kv_heads * spec.head_dim == attn.k_proj.out_features
                assert spec.k_eq_v == (attn.v_proj is None)


def test_e2b_config_layer_plan():
    config = ModelConfig.from_hf_config(E2B_TEXT_CONFIG)
    assert [s.kv_mode for s in config.layers] == ["own"] * 13 + ["store", "store"] + ["reuse"] * 20
    assert {s.kv_donor for s in config.layers[15:] if s.attention_type == "sliding_attention"} == {13}
    assert {s.kv_donor for s in config.layers[15:] if s.attention_type == "full_attention"} == {14}
    assert [s.intermediate_size for s in config.layers] == [6144] * 15 + [12288] * 20
    assert {s.head_dim for s in config.layers if s.attention_type == "full_attention"} == {512}


def test_config_accepts_flat_and_per_layer_global_head_dim_alike():
    flat = ModelConfig.from_hf_config(E2B_TEXT_CONFIG)
    saved = {k: v for k, v in E2B_TEXT_CONFIG.items() if k != "global_head_dim"}
    saved["per_layer_config"] = {f"{i:02d}": {"head_dim": 512} for i in range(4, 35, 5)}
    assert ModelConfig.from_hf_config(saved) == flat
    nested = {"model_type": "gemma4", "text_config": dict(E2B_TEXT_CONFIG), "eos_token_id": [1, 106]}
    assert ModelConfig.from_hf_config(nested, {"eos_token_id": [1, 106, 50]}).eos_token_ids == (1, 50, 106)
    assert hash(flat) == hash(ModelConfig.from_hf_config(E2B_TEXT_CONFIG))  # static jit argument


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),  # MoE runs (test_family_parity) when sized
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_kv_shared_layers": 35}, "no layer to produce"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1.0}}}, "yarn"),
    ],
)
def test_config_refuses_what_it_cannot_run(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config({**E2B_TEXT_CONFIG, **change})


def test_e2b_full_size_loader_accounting_without_allocating():
    """The real loader maps a full-size E2B multimodal checkpoint (abstract tensors, nothing allocated):
    4,628,569,344 text parameters; towers and the shared layers' unused K/V are skipped; bytes counted
    as stored (bf16 matrices, fp32 norms)."""
    config = ModelConfig.from_hf_config({"model_type": "gemma4", "text_config": E2B_TEXT_CONFIG})
    specs = param_specs(config)
    tensors = {f"model.language_model.{s.hf_name}": jax.ShapeDtypeStruct(s.shape, jnp.bfloat16) for s in specs}
    tensors["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)
    tensors["model.language_model.layers.34.self_attn.k_proj.weight"] = jax.ShapeDtypeStruct((512, 1536), jnp.bfloat16)
    kept = {}

    def load(abstract):
        params, kept["bytes"] = build_params(config, sorted(abstract), abstract.__getitem__, jnp.bfloat16)
        return params

    params = jax.eval_shape(load, tensors)
    # transformers counts the 35 layer_scalar values as buffers, not parameters
    assert count_params(params) == E2B_TEXT_PARAMS + 35
    norms = sum(int(np.prod(s.shape)) for s in specs if s.kind == "norm")
    assert norms == 268_800 + 15_360 + 1536 + 256  # layer norms, q/k norms, final norm, PLE norm
    # 9,257,138,688 B in bf16 (spec §15), plus 2 more bytes per norm (kept in fp32) and the fp32 scalars
    assert kept["bytes"] == 2 * E2B_TEXT_PARAMS + 2 * norms + 4 * 35


def _rewrite(src, dst, rename=lambda k: k, drop=(), reshape=None, config=None, extra=None):
    dst.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {rename(k): v for k, v in tensors.items() if k not in drop}
    if reshape:
        out[reshape] = out[reshape][:, :-1]
    out.update(extra or {})
    save_file(out, str(dst / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(hf) if config else hf))


def test_multimodal_layout_and_sharded_checkpoint_load_identically(hf_checkpoints, tmp_path):
    directory, model = hf_checkpoints["g4_shared"]
    reference = load_checkpoint(directory, jnp.float32)
    _rewrite(directory, tmp_path / "mm", rename=lambda k: k.replace("model.", "model.language_model.", 1),
             config=lambda hf: {"model_type": "gemma4", "text_config": hf, "eos_token_id": [1, 106]},
             extra={"model.vision_tower.patch.weight": np.zeros((4, 4), np.float32),
                    "model.language_model.layers.5.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)})
    multimodal = load_checkpoint(tmp_path / "mm", jnp.float32)
    assert _leaves_equal(multimodal.params, reference.params)
    assert multimodal.weight_bytes == reference.weight_bytes
    assert multimodal.config.eos_token_ids == (1, 106)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = load_checkpoint(tmp_path / "sharded", jnp.float32)
    assert _leaves_equal(sharded.params, reference.params)


def test_bad_checkpoints_give_clear_errors(hf_checkpoints, tmp_path):
    directory, _ = hf_checkpoints["g4_plain"]
    _rewrite(directory, tmp_path / "missing", drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors in checkpoint: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path / "missing")
    _rewrite(directory, tmp_path / "shape", reshape="model.layers.2.self_attn.o_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight has shape \(48, 47\), config expects \(48, 48\)"):
        load_checkpoint(tmp_path / "shape")
    _rewrite(directory, tmp_path / "extra", extra={"model.layers.0.mystery.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors in checkpoint: model\.layers\.0\.mystery\.weight"):
        load_checkpoint(tmp_path / "extra")
    _rewrite(directory, tmp_path / "moe", config=lambda hf: {**hf, "enable_moe_block": True})
    with pytest.raises(ConfigError, match="enable_moe_block"):
        load_checkpoint(tmp_path / "moe")
    _rewrite(directory, tmp_path / "llama", config=lambda hf: {**hf, "model_type": "llama"})
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_checkpoint(tmp_path / "llama")
    with pytest.raises(CheckpointError, match="neither a local directory nor a hub id"):
        load_checkpoint(str(tmp_path / "does" / "not" / "exist"))


def test_hub_id_offline_and_absent_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        load_checkpoint("google/gemma-4-E2B-it")


def test_hub_id_resolves_from_the_cache(hf_checkpoints, monkeypatch, tmp_path):
    """A snapshot in the HF cache layout loads by hub id, offline."""
    directory, _ = hf_checkpoints["g4_plain"]
    snapshot = tmp_path / "hf" / "hub" / "models--acme--tiny-gemma" / "snapshots" / ("0" * 40)
    shutil.copytree(directory, snapshot)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    loaded = load_checkpoint("acme/tiny-gemma", jnp.float32)
    assert loaded.config.num_layers == 4
