"""GGUF loading: files written by the `gguf` library from small random transformers checkpoints load to
the same config and params as the safetensors originals.

`write_gguf` plays llama.cpp's `convert_hf_to_gguf.py` on a checkpoint directory: tensor names through
gguf-py's own TensorNameMap (HF -> GGUF, the converter's direction), +1 on Gemma 3 norm weights, Gemma
4's `layer_scalar` as `layer_output_scale.weight` and its `rope_freqs` factors, metadata through
`GGUFWriter.add_*`, and matrices optionally quantised with gguf-py's Q8_0 kernel.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from gemmax.model.forward import forward
from gemmax.model.kv_cache import init_cache
from gemmax.weights.checkpoint import CheckpointError
from gemmax.weights.gguf import GGUFError, open_gguf
from gemmax.weights.load import load_checkpoint, open_source

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def tiny_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary of `size` tokens: controls, two user-defined, letters, merges."""
    tokens, types = list(SPECIALS), [gguf.TokenType.CONTROL] * len(SPECIALS)
    tokens += ["\n", "  "]
    types += [gguf.TokenType.USER_DEFINED] * 2
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁a", "▁b", "ab", "▁ab", "ba", "▁ba", "▁c", "cd", "▁cd"]
    pieces += [f"▁{a}{b}" for a in "efghijkl" for b in "mnopqrstuvwxyz"]
    normal = [p for p in pieces if p not in tokens][: size - len(tokens)]
    tokens += normal
    types += [gguf.TokenType.NORMAL] * len(normal)
    assert len(tokens) == size
    scores = [0.0 if t != gguf.TokenType.NORMAL else -float(i) for i, t in enumerate(types)]
    return tokens, scores, [int(t) for t in types]


def write_gguf(model_dir: Path, out: Path, quant: gguf.GGMLQuantizationType | None = None) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    arch = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}[config["model_type"]]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch_enum, layers)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_sliding_window(config["sliding_window"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        types = config["layer_types"]
        if types != ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]:
            # llama.cpp assumes every 6th layer full for gemma3 (all released sizes); other layouts
            # need the per-layer pattern key, which the loader reads when present.
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        if rope["full_attention"]["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        types = config["layer_types"]
        shared = config["num_kv_shared_layers"]
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        per_layer = config.get("per_layer_config") or {}
        full_head_dim = per_layer[str(full[0])]["head_dim"]
        ff = config["intermediate_size"]
        writer.add_feed_forward_length([ff * (2 if config["use_double_wide_mlp"] and i >= layers - shared else 1)
                                        for i in range(layers)])
        writer.add_head_count_kv([per_layer.get(str(i), {}).get("num_key_value_heads", config["num_key_value_heads"])
                                  for i in range(layers)])
        writer.add_key_length(full_head_dim)
        writer.add_value_length(full_head_dim)
        writer.add_key_length_swa(config["head_dim"])
        writer.add_value_length_swa(config["head_dim"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_shared_kv_layers(shared)
        writer.add_embedding_length_per_layer_input(config["hidden_size_per_layer_input"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        rotated = int(full_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
        factors = [1.0] * rotated + [1e30] * (full_head_dim // 2 - rotated)
        writer.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))

    tokens, scores, types = tiny_vocab(config["vocab_size"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)

    with safe_open(model_dir / "model.safetensors", framework="numpy") as f:
        for name in sorted(f.keys()):
            tensor = f.get_tensor(name).astype(np.float32)
            if arch == "gemma3" and name.endswith("norm.weight"):
                tensor = tensor + 1  # Gemma3Model.norm_shift
            key = name + ".weight" if name.endswith("layer_scalar") else name
            gguf_name = name_map.get_name(key, try_suffixes=(".weight",))
            assert gguf_name is not None, name
            if quant is not None and tensor.ndim == 2:
                writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, quant), raw_dtype=quant)
            else:
                writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _same_config(from_gguf, original):
    # A GGUF adds llama.cpp's end-of-generation ids (here <end_of_turn>) to the file's eos.
    assert set(original.eos_token_ids) <= set(from_gguf.eos_token_ids)
    assert dataclasses.replace(from_gguf, eos_token_ids=original.eos_token_ids) == original


def param_leaves(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize("name", ["g3_small", "g4_shared", "g4_k_eq_v"])
def test_float32_gguf_loads_to_the_safetensors_params(hf_checkpoints, tmp_path, name):
    directory, _ = hf_checkpoints[name]
    original = load_checkpoint(directory, weight_dtype=jnp.float32)
    loaded = load_checkpoint(write_gguf(directory, tmp_path / f"{name}.gguf"), weight_dtype=jnp.float32)
    _same_config(loaded.config, original.config)
    want, got = param_leaves(original.params), param_leaves(loaded.params)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        # Matrices round-trip exactly; Gemma 3 norms pass through (w + 1) - 1 + 1 in float32.
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert loaded.weight_bytes == original.weight_bytes
    assert loaded.source.directory is None and loaded.source.tokenizer is not None


# Worst-case error of one stored weight, relative to the largest |w| of its matrix.
STORAGE = {"Q8_0": 1 / 127, "BF16": 2**-8, "F16": 2**-11}


@pytest.mark.parametrize("qtype", sorted(STORAGE))
def test_quantised_gguf_dequantises_within_its_error_and_keeps_the_logits(hf_checkpoints, tmp_path, qtype):
    directory, _ = hf_checkpoints["g3_small"]
    original = load_checkpoint(directory, weight_dtype=jnp.float32)
    loaded = load_checkpoint(write_gguf(directory, tmp_path / f"{qtype}.gguf", gguf.GGMLQuantizationType[qtype]),
                       weight_dtype=jnp.float32)
    want, got = param_leaves(original.params), param_leaves(loaded.params)
    for key in want:
        bound = np.abs(want[key]).max() * STORAGE[qtype] if want[key].ndim == 2 else 1e-6  # norms stay F32
        err = np.abs(got[key] - want[key]).max()
        assert err <= bound, f"{key}: {err:.2e} > {bound:.2e}"
        if want[key].ndim == 2:
            assert err > 0, f"{key} was not stored as {qtype}: the test would prove nothing"
    ids = jnp.asarray([[2, 17, 33, 5, 61, 8, 40, 9, 11]], jnp.int32)
    logits = [np.asarray(forward(ck.params, init_cache(ck.config, 1, 16), ids, jnp.array([0]), jnp.array([9]),
                                 config=ck.config)[0]) for ck in (original, loaded)]
    assert np.abs(logits[0] - logits[1]).max() < 0.05 * np.abs(logits[0]).max()


def test_gguf_tokenizer_and_chat_template_from_metadata(hf_checkpoints, tmp_path):
    directory, _ = hf_checkpoints["g3_small"]
    contents = open_gguf(write_gguf(directory, tmp_path / "g3.gguf"))
    tokenizer = contents.tokenizer
    assert tokenizer.bos_token_id == 2 and contents.config.eos_token_ids == (1, 6)
    ids = tokenizer.encode("ab ab\n  cd")  # merges by score; "\n" and "  " are user-defined, kept whole
    vocab = tokenizer.backend.get_vocab()
    assert ids == [2, vocab["ab"], vocab["▁ab"], vocab["\n"], vocab["  "], vocab["cd"]]
    assert tokenizer.decode(ids) == "ab ab\n  cd"
    chat = tokenizer.encode_chat([{"role": "user", "content": "ab"}])
    assert chat[:2] == [2, 5] and chat[-1] == vocab["\n"]  # <bos><start_of_turn> ... model\n


def test_unsupported_architecture_is_refused(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'llama' is not supported"):
        load_checkpoint(tmp_path / "llama.gguf")


def test_missing_tensor_and_non_gguf_are_refused(hf_checkpoints, tmp_path):
    directory, _ = hf_checkpoints["g3_small"]
    path = write_gguf(directory, tmp_path / "g3.gguf")
    trimmed = tmp_path / "trimmed" / "model.safetensors"
    trimmed.parent.mkdir()
    from safetensors.numpy import save_file

    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        save_file({k: f.get_tensor(k) for k in sorted(f.keys()) if k != "model.layers.2.mlp.up_proj.weight"}, trimmed)
    (trimmed.parent / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing tensors in checkpoint: model\.layers\.2\.mlp\.up_proj"):
        load_checkpoint(write_gguf(trimmed.parent, tmp_path / "missing.gguf"))
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_checkpoint(tmp_path / "fake.gguf")
    assert load_checkpoint(path, weight_dtype=jnp.float32).config.family == "gemma3"  # dispatch by suffix


def test_quant_auto_keeps_a_quantised_gguf_in_int8(hf_checkpoints, tmp_path):
    """`--quant auto` (the CLI default): a GGUF whose matrices are stored at 8 bits (Q8_0) loads as int8
    layers and an int8 LM head; a float GGUF, an HF directory, or an explicit --dtype load unquantised."""
    from gemmax.engine.loading import load_model
    from gemmax.quant import Int8Weight, QuantOptions

    directory, _ = hf_checkpoints["g3_small"]
    q8 = write_gguf(directory, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    bf16 = write_gguf(directory, tmp_path / "bf16.gguf", gguf.GGMLQuantizationType.BF16)
    stored_quantized = [open_source(str(path), weights=False).stored_quantized for path in (q8, bf16, directory)]
    assert stored_quantized == [True, False, False]
    auto = QuantOptions(quant="auto")
    loaded = load_model(str(q8), None, auto)
    assert (loaded.policy.quant.quant, loaded.policy.quant.int8_lm_head) == ("int8", True)
    layer = loaded.checkpoint.params["layers"][0]
    assert isinstance(layer["q"], Int8Weight) and isinstance(loaded.checkpoint.params["lm_head"], Int8Weight)
    for model, dtype in ((str(q8), "float32"), (str(bf16), None), (str(directory), None)):
        plain = load_model(model, dtype, auto)
        assert plain.policy.quant.quant == "none" and not plain.policy.quant.int8_lm_head
        assert plain.checkpoint.params["layers"][0]["q"].dtype in (jnp.float32, jnp.bfloat16)


def test_a_gguf_model_is_opened_once_and_its_config_parsed_once_from_serve_start_to_ready(
        hf_checkpoints, tmp_path, monkeypatch):
    """`gemmax serve --model x.gguf` resolves the file once (`open_source`): --quant auto, the config,
    the tokenizer and the weights all read that one ModelSource."""
    import gemmax.weights.gguf as gguf_module
    from gemmax.engine.loading import start_engine
    from gemmax.model.config import ModelConfig
    from gemmax.quant import QuantOptions

    path = write_gguf(hf_checkpoints["g3_small"][0], tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    opened, parsed = [], []
    reader, from_hf_config = gguf_module.GGUFReader, ModelConfig.from_hf_config.__func__

    def counting_reader(*args, **kwargs):
        opened.append(args)
        return reader(*args, **kwargs)

    def counting_parse(cls, *args, **kwargs):
        parsed.append(args)
        return from_hf_config(cls, *args, **kwargs)

    monkeypatch.setattr(gguf_module, "GGUFReader", counting_reader)
    monkeypatch.setattr(ModelConfig, "from_hf_config", classmethod(counting_parse))
    engine, tokenizer = start_engine(str(path), None, QuantOptions(quant="auto"), max_model_len=32, max_batch=1,
                                     buckets=(16,))
    try:
        assert engine.wait_ready(300) and tokenizer is not None
        assert engine.info["policy"]["quant"]["quant"] == "int8"  # --quant auto saw the Q8_0 storage
    finally:
        engine.shutdown(drain_timeout=1)
    assert len(opened) == 1 and len(parsed) == 1
