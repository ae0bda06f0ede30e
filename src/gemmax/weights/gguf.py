"""GGUF files (llama.cpp's format) -> a `ModelSource` whose tensors go through the same one name map
as safetensors (`checkpoint.build_params`).

A GGUF carries the config as metadata, the tokenizer as metadata, and the tensors under llama.cpp's
names (`blk.N.attn_q.weight`), possibly quantised (Q4_K, Q5_0, Q6_K, Q8_0 ...). Loading it is three
translations, after which `checkpoint.build_params` applies the one map and its checks:

1. metadata -> an HF-style config dict (`gemma3_text` / `gemma4_text`) -> `ModelConfig.from_hf_config`;
   the fields llama.cpp does not store it hard-codes per architecture, and so do we (see
   `_gemma3_config`);
2. tensor names: each HF name the config expects -> its GGUF name through gguf-py's own
   `TensorNameMap` (the table llama.cpp's converter writes with), dequantised by gguf-py's numpy
   kernels. GGUF lists dims innermost-first, so a `[in, out]` GGUF shape is numpy's `[out, in]`, the
   HF layout. llama.cpp's converter does not permute Q/K for Gemma (only its Llama path does), but it
   adds 1 to Gemma 3 norm weights (Gemma3RMSNorm scales by 1 + w), so the 1 is taken off here and
   `build_params` adds it back (Gemma 4 norms are stored as is);
3. the tokenizer: vocabulary, scores, token types and special ids -> a `tokenizers` BPE whose ids
   equal llama.cpp's (`tokenizer_from_gguf`), plus a built-in Gemma 3 chat template (the files carry
   none).

`open_gguf` exposes the translated config, names and reader on their own: `gemmax.weights.builtin` uses them
to convert a GGUF once into an HF directory that loads fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from gemmax.model.config import FULL, SLIDING, ModelConfig
from gemmax.model.params import param_specs
from gemmax.weights.checkpoint import CheckpointError
from gemmax.weights.source import ModelSource
from gemmax.weights.tokenizer import Tokenizer

ARCHITECTURES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
HF_PREFIX = "model."
# Tensors llama.cpp stores that gemmax derives from the config instead: Gemma 4's proportional-RoPE
# frequency factors (1 on rotated pairs, 1e30 on the rest; read for the rotary fraction).
DERIVED_TENSORS = ("rope_freqs.weight",)
# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Gemma 3's chat template, as the HF checkpoints ship it (text parts only): roles user/model, the
# system prompt folded into the first user turn, content trimmed, `<bos>` written by the template.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


class GGUFError(CheckpointError):
    """A GGUF file gemmax cannot load, with the reason (architecture, metadata key, tensor)."""


@dataclasses.dataclass(frozen=True)
class GGUFContents:
    """A GGUF file translated to Hugging Face conventions; tensors are read lazily."""

    architecture: str  # general.architecture: gemma3 | gemma4
    hf_config: dict[str, Any]  # as a transformers config.json would have it
    config: ModelConfig
    names: list[str]  # HF tensor names ("model.layers.0.self_attn.q_proj.weight"), plus any unmapped GGUF names
    read: Callable[[str], np.ndarray]  # HF name -> float32 array in HF layout and convention
    tokenizer: Tokenizer
    tokenizer_files: dict[str, Any]  # special tokens and flags, as tokenizer_config.json would have them
    gguf_names: dict[str, str]  # HF name -> GGUF tensor name
    quantized: bool  # some weight matrix is stored at 8 bits or fewer (Q8_0, Q6_K, Q4_K, ...)


class _Metadata:
    """Typed access to a GGUF's key/value metadata, with the architecture's prefix filled in."""

    def __init__(self, reader, path: Path):
        from gguf import GGUFValueType

        self.float32 = GGUFValueType.FLOAT32
        self.fields = reader.fields
        self.path = path
        self.arch = ""
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = ...) -> Any:
        key = key.format(arch=self.arch)
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        value = field.contents()
        if field.types == [self.float32]:
            value = float(str(np.float32(value)))  # the decimal the writer was given: 1e-06, not 9.99999997e-07
        return value

    def has(self, key: str) -> bool:
        return key.format(arch=self.arch) in self.fields


def open_gguf(path: Path) -> GGUFContents:
    """Read a GGUF's metadata and tensor index (memory-mapped; no tensor data is read yet)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no such GGUF file: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # not a GGUF, truncated, wrong magic
        raise GGUFError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    meta = _Metadata(reader, path)
    if meta.arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {meta.arch!r} is not supported: gemmax loads {sorted(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    if "output.weight" in tensors:
        raise GGUFError(f"{path}: has an untied output.weight; Gemma ties the LM head to token_embd")
    tokenizer, tokenizer_files = tokenizer_from_gguf(meta)
    hf_config = _gemma3_config(meta, tensors) if meta.arch == "gemma3" else _gemma4_config(meta, tensors)
    hf_config["eos_token_id"] = _eos_ids(meta, tokenizer)
    config = ModelConfig.from_hf_config(hf_config)

    gguf_names = _gguf_names(meta.arch, config)
    norms = {HF_PREFIX + s.hf_name for s in param_specs(config) if s.kind == "norm"}
    norm_shift = 1.0 if meta.arch == "gemma3" else 0.0  # llama.cpp stores Gemma 3 norms as 1 + w
    mapped = {g: h for h, g in gguf_names.items() if g in tensors}
    names = [mapped.get(name, name) for name in tensors if name not in DERIVED_TENSORS]

    def read(name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = tensors[gguf_names.get(name, name)]
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF dims are innermost-first
        if tensor.tensor_type == GGMLQuantizationType.F32:
            array = np.asarray(tensor.data, np.float32)
        else:
            array = dequantize(tensor.data, tensor.tensor_type)  # -> float32 [out, in]
        array = array.reshape(shape)
        if name in norms and norm_shift:
            array = array - np.float32(norm_shift)
        return array

    return GGUFContents(meta.arch, hf_config, config, names, read, tokenizer, tokenizer_files, gguf_names,
                        quantized=stores_quantized(reader))


def stores_quantized(reader) -> bool:
    """Whether a GGUF (a `gguf.GGUFReader`) stores some matrix in a quantised type rather than F32/F16/BF16."""
    from gguf import GGMLQuantizationType as T

    return any(len(t.shape) == 2 and t.tensor_type not in (T.F32, T.F16, T.BF16) for t in reader.tensors)


def gguf_source(name: str, path: Path) -> ModelSource:
    """A ModelSource over a GGUF file: opened once here (config, tokenizer, tensor index); its tensors
    are dequantised as the loader reads them."""
    contents = open_gguf(path)
    return ModelSource(name=name, kind="gguf", path=Path(path), config=contents.config,
                       stored_quantized=contents.quantized, tensors=lambda: (contents.names, contents.read),
                       open_tokenizer=lambda: contents.tokenizer)


# ------------------------------------------------------------------------------------------ names


def _gguf_names(arch: str, config: ModelConfig) -> dict[str, str]:
    """HF name -> GGUF name for every tensor the config expects, through gguf-py's TensorNameMap."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, get_tensor_name_map

    arch_enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch and isinstance(a, MODEL_ARCH))
    name_map = get_tensor_name_map(arch_enum, config.num_layers)
    out = {}
    for spec in param_specs(config):
        hf = HF_PREFIX + spec.hf_name
        # llama.cpp's converter names suffix-less tensors (Gemma 4's layer_scalar) "<name>.weight".
        base = hf[: -len(".weight")] if hf.endswith(".weight") else hf
        gguf_base = name_map.get_name(base)
        if gguf_base is None:
            raise GGUFError(f"gguf-py has no {arch} tensor name for {hf}")
        out[hf] = gguf_base + ".weight"
    return out


# ------------------------------------------------------------------------------------------ config


def _per_layer(value: Any, num_layers: int, key: str) -> list[int]:
    """A per-layer GGUF value (a scalar, or an array with one entry per layer) as a list."""
    if isinstance(value, list):
        if len(value) != num_layers:
            raise GGUFError(f"metadata {key} has {len(value)} entries for {num_layers} layers")
        return [int(v) for v in value]
    return [int(value)] * num_layers


def _common_config(meta: _Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    return {
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # converter trims rows to the tokenizer
        "hidden_size": int(meta.get("{arch}.embedding_length")),
        "num_hidden_layers": int(meta.get("{arch}.block_count")),
        "sliding_window": int(meta.get("{arch}.attention.sliding_window")),
        "rms_norm_eps": float(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get("{arch}.context_length", 131_072)),
        "final_logit_softcapping": meta.get("{arch}.final_logit_softcapping", None),
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "use_bidirectional_attention": False,
    }


def _gemma3_config(meta: _Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """gemma3 metadata -> gemma3_text config, with llama.cpp's hard-coded Gemma 3 values
    (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer full, sliding RoPE base 1e4, attention scale
    1/sqrt(head_dim) except on the 62-layer 27B (1/sqrt(hidden/heads), HF's query_pre_attn_scalar 168)."""
    config = _common_config(meta, tensors)
    layers, heads = config["num_hidden_layers"], int(meta.get("{arch}.attention.head_count"))
    head_dim = int(meta.get("{arch}.attention.key_length", 256))
    if int(meta.get("{arch}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError("gemma3 GGUF with key_length != value_length")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("{arch}.rope.freq_base", 1e6))}
    scaling = meta.get("{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        full = {**full, "rope_type": "linear", "factor": float(meta.get("{arch}.rope.scaling.factor"))}
    elif scaling != "none":
        raise GGUFError(f"gemma3 GGUF with rope scaling {scaling!r}: only linear is supported")
    pattern = meta.get("{arch}.attention.sliding_window_pattern", None)
    if isinstance(pattern, list):
        types = [SLIDING if swa else FULL for swa in pattern]
    else:
        period = int(pattern) if pattern else 6
        types = [SLIDING if (i + 1) % period else FULL for i in range(layers)]
    return {
        **config,
        "model_type": "gemma3_text",
        "intermediate_size": int(meta.get("{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("{arch}.attention.head_count_kv")),
        "head_dim": head_dim,
        "query_pre_attn_scalar": config["hidden_size"] // heads if layers == 62 else head_dim,
        "layer_types": types,
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}, FULL: full},
    }


def _gemma4_config(meta: _Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """gemma4 metadata (written by llama.cpp's Gemma4Model converter) -> gemma4_text config."""
    config = _common_config(meta, tensors)
    layers = config["num_hidden_layers"]
    pattern = meta.get("{arch}.attention.sliding_window_pattern")
    swa = [bool(v) for v in (pattern if isinstance(pattern, list) else [pattern] * layers)]
    types = [SLIDING if s else FULL for s in swa]
    shared = int(meta.get("{arch}.attention.shared_kv_layers", 0))
    ff = _per_layer(meta.get("{arch}.feed_forward_length"), layers, "feed_forward_length")
    first_shared = layers - shared
    double_wide = shared > 0 and all(ff[i] == 2 * ff[0] for i in range(first_shared, layers))
    if any(f != ff[0] for f in ff[:first_shared]) or (shared and not double_wide and len(set(ff)) > 1):
        raise GGUFError(f"gemma4 GGUF with per-layer feed_forward_length {ff}: not a Gemma 4 MLP layout")
    heads = _per_layer(meta.get("{arch}.attention.head_count"), layers, "head_count")
    if len(set(heads)) != 1:
        raise GGUFError(f"gemma4 GGUF with per-layer head counts {heads}")
    kv = _per_layer(meta.get("{arch}.attention.head_count_kv"), layers, "head_count_kv")
    kv_swa = {k for k, s in zip(kv, swa, strict=True) if s} or {kv[0]}
    if len(kv_swa) > 1:
        raise GGUFError(f"gemma4 GGUF with per-layer kv head counts {kv} on sliding layers")
    global_head_dim = int(meta.get("{arch}.attention.key_length"))
    # k_eq_v: full layers that own a KV cache carry no attn_v (V is the raw K projection).
    full_owners = [i for i in range(first_shared) if not swa[i]]
    k_eq_v = bool(full_owners) and all(f"blk.{i}.attn_v.weight" not in tensors for i in full_owners)
    rope_full: dict[str, Any] = {"rope_type": "proportional", "rope_theta": float(meta.get("{arch}.rope.freq_base")),
                                 "partial_rotary_factor": _rotary_fraction(tensors, global_head_dim)}
    out = {
        **config,
        "model_type": "gemma4_text",
        "intermediate_size": ff[0],
        "use_double_wide_mlp": double_wide,
        "num_attention_heads": heads[0],
        "num_key_value_heads": kv_swa.pop(),
        "head_dim": int(meta.get("{arch}.attention.key_length_swa")),
        "per_layer_config": {str(i): {"head_dim": global_head_dim, "num_key_value_heads": kv[i]}
                             for i in range(layers) if not swa[i]},
        "attention_k_eq_v": k_eq_v,
        "layer_types": types,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(meta.get("{arch}.embedding_length_per_layer_input", 0)),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": float(meta.get("{arch}.rope.freq_base_swa", 10_000.0))},
            FULL: rope_full,
        },
        "enable_moe_block": "blk.0.ffn_gate_inp.weight" in tensors,
    }
    if "per_layer_token_embd.weight" in tensors:
        out["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"].shape[1])
    return out


def _rotary_fraction(tensors: dict[str, Any], head_dim: int) -> float:
    """Full layers' rotary fraction from llama.cpp's rope_freqs (1.0 on rotated pairs, 1e30 on the rest)."""
    if "rope_freqs.weight" not in tensors:
        return 1.0
    factors = np.asarray(tensors["rope_freqs.weight"].data, np.float32)
    return 2 * int(np.sum(factors == 1.0)) / head_dim


def _eos_ids(meta: _Metadata, tokenizer: Tokenizer) -> list[int]:
    """The file's eos plus the end-of-turn tokens llama.cpp also stops on (its end-of-generation set)."""
    ids = [int(meta.get("tokenizer.ggml.eos_token_id", 1))]
    for text in ("<end_of_turn>", "<turn|>", "<|tool_response>"):
        token = tokenizer.token_to_id(text)
        if token is not None and token not in ids:
            ids.append(token)
    return ids


# ------------------------------------------------------------------------------------------ tokenizer


def tokenizer_from_gguf(meta: _Metadata) -> tuple[Tokenizer, dict[str, Any]]:
    """A `tokenizers` BPE with llama.cpp's behaviour for a SentencePiece-style ("llama") vocabulary.

    llama.cpp tokenizes such a vocabulary by (1) cutting out control tokens (when special tokens are
    parsed) and user-defined tokens (always) as whole pieces, longest first, (2) replacing " " with
    "▁" (no prefix space for Gemma), (3) merging adjacent symbols greedily, best-scored merged token
    first, and (4) falling back to `<0xXX>` byte tokens for characters not in the vocabulary. Here:
    (1) control tokens are special added tokens and user-defined tokens plain added tokens, matched on
    the raw text; (2) a Replace normalizer; (3) BPE merges ranked by the merged token's score (files
    that list merges, such as Gemma 4's, give them in order); (4) BPE's byte fallback.
    """
    from tokenizers import AddedToken, decoders, normalizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model not in ("llama", "gemma4"):
        raise GGUFError(f"{meta.path}: tokenizer model {model!r} is not a Gemma (SentencePiece) vocabulary")
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise GGUFError(f"{meta.path}: tokenizer adds a prefix space, which Gemma vocabularies do not")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    if meta.has("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    else:
        merges = _merges_from_scores(tokens, meta.get("tokenizer.ggml.scores"), types)
    unk = tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 3))]
    backend = Backend(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED])

    specials = {}
    for name, key, fallback in (("bos_token", "bos_token_id", 2), ("eos_token", "eos_token_id", 1),
                                ("unk_token", "unknown_token_id", 3), ("pad_token", "padding_token_id", 0)):
        specials[name] = tokens[int(meta.get(f"tokenizer.ggml.{key}", fallback))]
    template = meta.get("tokenizer.chat_template", None)
    if template is None and meta.arch == "gemma3":
        template = GEMMA3_CHAT_TEMPLATE
    files = {**specials, "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
             "chat_template": template}
    return Tokenizer(backend, vocab[specials["bos_token"]], template, specials), files


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces is a merge, ranked by the merged
    token's score (best first; llama.cpp's SentencePiece merge order), then by token id, then by
    longer left piece. Only normal tokens are merge results: the rest are matched whole or are bytes."""
    vocab = {token: i for i, token in enumerate(tokens)}
    order = sorted((i for i, kind in enumerate(types) if kind == NORMAL), key=lambda i: (-scores[i], i))
    merges = []
    for i in order:
        token = tokens[i]
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges

