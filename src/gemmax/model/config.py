"""Frozen, hashable model config parsed from a Hugging Face `config.json`.

One entry point, `ModelConfig.from_hf_config(dict)`, accepts:
- `model_type: gemma4_text` (and `gemma4` with a nested `text_config`: the text decoder only);
- `model_type: gemma3_text` (and `gemma3` with a nested `text_config`).

Per-layer geometry is resolved here once (head dim, kv heads, KV-sharing donor, MLP width, RoPE), so
the model code reads `config.layers[i]` and never re-derives it. Fields that would change the math
but are not implemented (bidirectional attention, attention-logit softcap ...) are refused with
a message that names them, never ignored. The MoE block (26B-A4B, `enable_moe_block`) is parsed into
`num_experts` / `top_k_experts` / `moe_intermediate_size` (0 when the block is off). The config is a static argument to `jax.jit`, so it is
frozen and every field is hashable; change it with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]


class ConfigError(ValueError):
    """A checkpoint config gemmax cannot run, with the reason in the message."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type. `inv_freq` is derived in the model from these and the head dim."""

    rope_type: Literal["default", "proportional", "linear"]
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0  # divides every inverse frequency (linear scaling; optional for proportional)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Everything layer-specific, resolved from the HF config exactly as transformers 5.23 resolves it."""

    attention_type: LayerType
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # no v_proj: V is the raw K projection (Gemma 4 full layers with attention_k_eq_v)
    kv_mode: Literal["own", "store", "reuse"]  # HF kv_sharing_modes: None -> "own"
    kv_donor: int  # index of the layer whose K/V this layer attends to (itself unless "reuse")
    intermediate_size: int
    sliding_window: int | None  # keys visible: positions (q - window, q]; None for full attention

    @property
    def owns_kv(self) -> bool:
        return self.kv_mode != "reuse"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Literal["gemma4", "gemma3"]
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    layers: tuple[LayerSpec, ...]
    rope: tuple[tuple[str, RopeSpec], ...]  # (layer_type, spec) pairs; use `rope_for`
    rms_norm_eps: float
    hidden_size_per_layer_input: int  # PLE width P; 0 disables PLE
    vocab_size_per_layer_input: int
    final_logit_softcapping: float | None
    attention_scale: float  # Gemma 4: 1.0; Gemma 3: query_pre_attn_scalar ** -0.5
    norm_adds_one: bool  # Gemma 3 RMSNorm multiplies by (1 + w); Gemma 4 by w
    use_v_norm: bool
    use_layer_scalar: bool
    max_position_embeddings: int
    bos_token_id: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    # MoE block in every layer (Gemma 4 26B-A4B, spec section 12) next to the dense MLP; 0 = no MoE.
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @property
    def has_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rope_for(self, layer_type: str) -> RopeSpec:
        return dict(self.rope)[layer_type]

    @property
    def sliding_window(self) -> int | None:
        windows = {spec.sliding_window for spec in self.layers if spec.sliding_window is not None}
        return windows.pop() if windows else None

    @classmethod
    def from_hf_config(
        cls, hf: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        hf = dict(hf)
        model_type = hf.get("model_type")
        if model_type in ("gemma4", "gemma3"):
            if "text_config" not in hf:
                raise ConfigError(f"model_type {model_type!r} config has no 'text_config'")
            top_eos = hf.get("eos_token_id")
            hf = dict(hf["text_config"])
            hf.setdefault("model_type", f"{model_type}_text")
            if top_eos is not None:
                hf["eos_token_id"] = top_eos  # the multimodal top level carries the chat eos (e.g. [1, 106])
            model_type = hf["model_type"]
        if model_type == "gemma4_text":
            config = _parse_gemma4(hf)
        elif model_type == "gemma3_text":
            config = _parse_gemma3(hf)
        else:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: gemmax runs gemma4_text / gemma4 and gemma3_text / gemma3"
            )
        eos = set(config.eos_token_ids)
        if generation_config:
            eos |= set(_as_id_list(generation_config.get("eos_token_id")))
        return dataclasses.replace(config, eos_token_ids=tuple(sorted(eos)))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `config.json` (and `generation_config.json` when present) from a checkpoint directory."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"no config.json in {path}")
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
        return cls.from_hf_config(json.loads(config_file.read_text()), generation)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _refuse(hf: Mapping[str, Any], checks: Mapping[str, Any]) -> None:
    """Refuse fields that change the math but are not implemented: {field: value that is supported}."""
    for field, supported in checks.items():
        if field not in hf:
            continue
        value = hf[field]
        ok = supported(value) if callable(supported) else value == supported
        if not ok:
            raise ConfigError(f"unsupported config: {field}={value!r} changes the model and gemmax does not implement it")


# Values gemmax supports for fields both families carry (anything else changes the math).
_SUPPORTED_BY_BOTH: dict[str, Any] = {
    "use_bidirectional_attention": lambda v: v in (None, False),
    "attention_bias": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}


def _layer_types(hf: Mapping[str, Any], num_layers: int, pattern: int) -> list[str]:
    types = hf.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ConfigError(f"unsupported layer types {sorted(unknown)}")
    return types


def _rope_spec(params: Mapping[str, Any], layer_type: str) -> RopeSpec:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional", "linear"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} for {layer_type}")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params["rope_theta"]),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        factor=float(params.get("factor", 1.0)),
    )


def _kv_sharing(types: list[str], num_shared: int) -> tuple[list[str], list[int]]:
    """(mode, donor) per layer exactly as transformers' `kv_sharing_modes` assigns them."""
    num_layers = len(types)
    if num_shared == 0:
        return ["own"] * num_layers, list(range(num_layers))
    first_shared = num_layers - num_shared
    if first_shared <= 0:
        raise ConfigError(f"num_kv_shared_layers={num_shared} leaves no layer to produce a KV cache")
    producers = types[:first_shared]
    missing = set(types) - set(producers)
    if missing:
        raise ConfigError(
            f"num_kv_shared_layers={num_shared}: layer types {sorted(missing)} are shared but no earlier layer produces them"
        )
    store = {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types)}
    modes, donors = [], []
    for i, t in enumerate(types):
        if i >= first_shared:
            modes.append("reuse")
            donors.append(store[t])
        else:
            modes.append("store" if store[t] == i else "own")
            donors.append(i)
    return modes, donors


def _parse_gemma4(hf: Mapping[str, Any]) -> ModelConfig:
    # "vision" makes image tokens attend bidirectionally; the text decoder alone stays causal.
    _refuse(hf, {**_SUPPORTED_BY_BOTH, "use_bidirectional_attention": lambda v: v in (None, False, "vision")})
    moe = bool(hf.get("enable_moe_block", False))
    if moe and not all(hf.get(f) for f in ("num_experts", "top_k_experts", "moe_intermediate_size")):
        raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
    num_layers = int(hf["num_hidden_layers"])
    types = _layer_types(hf, num_layers, pattern=6)
    types[-1] = FULL  # transformers forces the last layer to full attention
    head_dim = int(hf.get("head_dim", 256))
    num_kv = int(hf["num_key_value_heads"])
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    per_layer = hf.get("per_layer_config")
    if per_layer is None:  # older hub configs: flat global_head_dim / num_global_key_value_heads
        override: dict[str, int] = {"head_dim": int(hf.get("global_head_dim", 512))}
        if k_eq_v and hf.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        per_layer = {str(i): override for i, t in enumerate(types) if t == FULL}
    per_layer = {int(k): dict(v) for k, v in per_layer.items()}
    for i, override in per_layer.items():
        unknown = set(override) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ConfigError(f"per_layer_config[{i}] overrides unsupported fields {sorted(unknown)}")

    rope_params = hf.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    missing = set(types) - set(rope_params)
    if missing:
        raise ConfigError(f"rope_parameters has no entry for {sorted(missing)}")

    modes, donors = _kv_sharing(types, int(hf.get("num_kv_shared_layers", 0)))
    intermediate = hf["intermediate_size"]
    if isinstance(intermediate, list):
        raise ConfigError("per-layer intermediate_size lists (Gemma 3n) are not supported")
    double_wide = bool(hf.get("use_double_wide_mlp", False))
    window = int(hf["sliding_window"])
    layers = tuple(
        LayerSpec(
            attention_type=t,
            head_dim=int(per_layer.get(i, {}).get("head_dim", head_dim)),
            num_kv_heads=int(per_layer.get(i, {}).get("num_key_value_heads", num_kv)),
            k_eq_v=k_eq_v and t == FULL,
            kv_mode=modes[i],
            kv_donor=donors[i],
            intermediate_size=int(intermediate) * (2 if double_wide and modes[i] == "reuse" else 1),
            sliding_window=window if t == SLIDING else None,
        )
        for i, t in enumerate(types)
    )
    num_heads = int(hf["num_attention_heads"])
    for i, spec in enumerate(layers):
        if num_heads % spec.num_kv_heads:
            raise ConfigError(f"layer {i}: {num_heads} heads not divisible by {spec.num_kv_heads} kv heads")
    ple = int(hf.get("hidden_size_per_layer_input", 256) or 0)
    return ModelConfig(
        family="gemma4",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=num_heads,
        layers=layers,
        rope=tuple(sorted((t, _rope_spec(rope_params[t], t)) for t in set(types))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(hf.get("vocab_size_per_layer_input", 262_144)) if ple else 0,
        final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
        attention_scale=1.0,
        norm_adds_one=False,
        use_v_norm=True,
        use_layer_scalar=True,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131_072)),
        bos_token_id=int(hf.get("bos_token_id", 2)),
        pad_token_id=int(hf.get("pad_token_id", 0) or 0),
        eos_token_ids=tuple(_as_id_list(hf.get("eos_token_id", 1))),
        num_experts=int(hf["num_experts"]) if moe else 0,
        top_k_experts=int(hf["top_k_experts"]) if moe else 0,
        moe_intermediate_size=int(hf["moe_intermediate_size"]) if moe else 0,
    )


def _parse_gemma3(hf: Mapping[str, Any]) -> ModelConfig:
    _refuse(hf, {"attn_logit_softcapping": None, **_SUPPORTED_BY_BOTH})
    num_layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    types = _layer_types(hf, num_layers, pattern=pattern)
    rope_params = hf.get("rope_parameters")
    if rope_params is None:  # pre-5.x saves: rope_theta / rope_local_base_freq / rope_scaling
        full = {"rope_type": "default", "rope_theta": float(hf.get("rope_theta", 1_000_000.0))}
        scaling = hf.get("rope_scaling")
        if scaling:
            full = {**full, "rope_type": scaling.get("rope_type", scaling.get("type")), "factor": scaling["factor"]}
        rope_params = {
            SLIDING: {"rope_type": "default", "rope_theta": float(hf.get("rope_local_base_freq", 10_000.0))},
            FULL: full,
        }
    head_dim = int(hf.get("head_dim", 256))
    window = int(hf["sliding_window"])
    layers = tuple(
        LayerSpec(
            attention_type=t,
            head_dim=head_dim,
            num_kv_heads=int(hf["num_key_value_heads"]),
            k_eq_v=False,
            kv_mode="own",
            kv_donor=i,
            intermediate_size=int(hf["intermediate_size"]),
            sliding_window=window if t == SLIDING else None,
        )
        for i, t in enumerate(types)
    )
    return ModelConfig(
        family="gemma3",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=int(hf["num_attention_heads"]),
        layers=layers,
        rope=tuple(sorted((t, _rope_spec(rope_params[t], t)) for t in set(types))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        norm_adds_one=True,
        use_v_norm=False,
        use_layer_scalar=False,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131_072)),
        bos_token_id=int(hf.get("bos_token_id", 2)),
        pad_token_id=int(hf.get("pad_token_id", 0) or 0),
        eos_token_ids=tuple(_as_id_list(hf.get("eos_token_id", 1))),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


E2B_TEXT_CONFIG: dict[str, Any] = {
    # google/gemma-4-E2B-it text_config (spec §1.1), for planning (`gemmax fit`) and shape tests.
    "model_type": "gemma4_text",
    "vocab_size": 262_144,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "attention_k_eq_v": False,
    "sliding_window": 512,
    "layer_types": ([SLIDING] * 4 + [FULL]) * 7,
    "num_kv_shared_layers": 20,
    "hidden_size_per_layer_input": 256,
    "use_double_wide_mlp": True,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
}

# The benchmark model of benchmarks/ and the docs: E2B's shapes with 6 layers instead of 35, keeping its
# 4:1-like mix and KV sharing (producers S S S F, consumers S F; double-wide MLP on the consumers).
E2B_SIX_LAYER_CONFIG: dict[str, Any] = {
    **E2B_TEXT_CONFIG,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 2,
    "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL],
}

# google/gemma-4-E4B-it text_config (spec section 1.2).
E4B_TEXT_CONFIG: dict[str, Any] = {
    **E2B_TEXT_CONFIG,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 42,
    "num_key_value_heads": 2,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 7,
    "num_kv_shared_layers": 18,
    "use_double_wide_mlp": False,
}

# google/gemma-4-31B-it text_config (spec section 1.3): no PLE, no KV sharing, attention_k_eq_v with
# 4 global KV heads on the full layers, window 1024.
G31B_TEXT_CONFIG: dict[str, Any] = {
    **E2B_TEXT_CONFIG,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "num_global_key_value_heads": 4,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 10,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
    "use_bidirectional_attention": "vision",
    "max_position_embeddings": 262_144,
}

# google/gemma-4-26B-A4B-it text_config (spec section 1.3): the 31B attention shape at 2816 wide, and
# in every layer a 2112-wide dense MLP next to 128 experts of 704 (top 8).
G26B_A4B_TEXT_CONFIG: dict[str, Any] = {
    **G31B_TEXT_CONFIG,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 2,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 5,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
}

# The published text configs by the names `gemmax fit` and the docs use.
FAMILY_TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "E2B": E2B_TEXT_CONFIG, "E4B": E4B_TEXT_CONFIG, "31B": G31B_TEXT_CONFIG, "26B-A4B": G26B_A4B_TEXT_CONFIG,
}
