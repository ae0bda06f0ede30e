"""Every parameter declared once: its Hugging Face name, its place in the params pytree, shape and kind.

The params pytree is

    {"embed": [V, H], "final_norm": [H],
     "ple_embed": [Vp, L*P], "ple_proj": [L*P, H], "ple_norm": [P],      # only when P > 0
     "layers": ({"q": [nh*hd, H], "q_norm": [hd], "k"/"v": [nkv*hd, H], "k_norm": [hd], "o": [H, nh*hd],
                 "gate"/"up": [I, H], "down": [H, I], "input_norm" ... : [H],
                 "ple_gate": [P, H], "ple_proj": [H, P], "ple_post_norm": [H], "layer_scalar": [1],
                 # MoE layers (26B-A4B) also: "router": [E, H], "router_scale": [H],
                 # "expert_scale": [E], "experts_gate_up": [E, 2*Im, H], "experts_down": [E, H, Im],
                 # "pre_ffn_norm_2" / "post_ffn_norm_1" / "post_ffn_norm_2": [H]
                 }, ...)}

Matrices keep the HF `[out, in]` layout (`x @ W.T`). Norm weights are stored in float32 and already
include Gemma 3's `+1`, so the model always multiplies by `w`. Loading (safetensors, GGUF), random
init, `eval_shape` checks and byte counting all derive from `param_specs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from gemmax.model.config import ModelConfig

# "router" (the MoE router [E, H]) and "experts" (stacked expert matrices [E, out, in]) are weights the
# load-time quantiser and the CPU column split leave as they are.
Kind = Literal["matrix", "embedding", "norm", "scalar", "router", "experts"]
Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    hf_name: str  # without the checkpoint prefix, e.g. "layers.3.self_attn.q_proj.weight"
    path: tuple[str | int, ...]  # e.g. ("layers", 3, "q")
    shape: tuple[int, ...]
    kind: Kind
    # Logical axis of each dim ("heads", "kv_heads", "ffn", "vocab", "experts" or None): what a mesh
    # shards it by (gemmax.model.sharding maps them to mesh axes). () = replicated.
    axes: tuple[str | None, ...] = ()

    def dtype(self, weight_dtype: Any) -> Any:
        """Norms and scalars stay float32 (tiny, and HF computes them in fp32); the rest uses weight_dtype."""
        return jnp.float32 if self.kind in ("norm", "scalar") else weight_dtype


def param_specs(config: ModelConfig) -> list[ParamSpec]:
    H, nh = config.hidden_size, config.num_attention_heads
    P, L = config.hidden_size_per_layer_input, config.num_layers
    specs = [
        ParamSpec("embed_tokens.weight", ("embed",), (config.vocab_size, H), "embedding", ("vocab", None)),
        ParamSpec("norm.weight", ("final_norm",), (H,), "norm"),
    ]
    if P:
        specs += [
            ParamSpec("embed_tokens_per_layer.weight", ("ple_embed",), (config.vocab_size_per_layer_input, L * P),
                      "embedding", ("vocab", None)),
            ParamSpec("per_layer_model_projection.weight", ("ple_proj",), (L * P, H), "matrix"),
            ParamSpec("per_layer_projection_norm.weight", ("ple_norm",), (P,), "norm"),
        ]
    for i, spec in enumerate(config.layers):
        hd, nkv, inter = spec.head_dim, spec.num_kv_heads, spec.intermediate_size

        def layer(name: str, key: str, shape: tuple[int, ...], kind: Kind, axes: tuple = (), i: int = i) -> ParamSpec:
            return ParamSpec(f"layers.{i}.{name}", ("layers", i, key), shape, kind, axes)

        specs += [
            layer("self_attn.q_proj.weight", "q", (nh * hd, H), "matrix", ("heads", None)),
            layer("self_attn.q_norm.weight", "q_norm", (hd,), "norm"),
            layer("self_attn.o_proj.weight", "o", (H, nh * hd), "matrix", (None, "heads")),
            layer("mlp.gate_proj.weight", "gate", (inter, H), "matrix", ("ffn", None)),
            layer("mlp.up_proj.weight", "up", (inter, H), "matrix", ("ffn", None)),
            layer("mlp.down_proj.weight", "down", (H, inter), "matrix", (None, "ffn")),
            layer("input_layernorm.weight", "input_norm", (H,), "norm"),
            layer("post_attention_layernorm.weight", "post_attn_norm", (H,), "norm"),
            layer("pre_feedforward_layernorm.weight", "pre_ffn_norm", (H,), "norm"),
            layer("post_feedforward_layernorm.weight", "post_ffn_norm", (H,), "norm"),
        ]
        if spec.owns_kv:
            specs += [
                layer("self_attn.k_proj.weight", "k", (nkv * hd, H), "matrix", ("kv_heads", None)),
                layer("self_attn.k_norm.weight", "k_norm", (hd,), "norm"),
            ]
            if not spec.k_eq_v:
                specs.append(layer("self_attn.v_proj.weight", "v", (nkv * hd, H), "matrix", ("kv_heads", None)))
        if config.has_moe:
            E, Im = config.num_experts, config.moe_intermediate_size
            specs += [
                layer("router.proj.weight", "router", (E, H), "router"),
                layer("router.scale", "router_scale", (H,), "norm"),
                layer("router.per_expert_scale", "expert_scale", (E,), "scalar"),
                layer("experts.gate_up_proj", "experts_gate_up", (E, 2 * Im, H), "experts", ("experts", None, None)),
                layer("experts.down_proj", "experts_down", (E, H, Im), "experts", ("experts", None, None)),
                layer("pre_feedforward_layernorm_2.weight", "pre_ffn_norm_2", (H,), "norm"),
                layer("post_feedforward_layernorm_1.weight", "post_ffn_norm_1", (H,), "norm"),
                layer("post_feedforward_layernorm_2.weight", "post_ffn_norm_2", (H,), "norm"),
            ]
        if P:
            specs += [
                layer("per_layer_input_gate.weight", "ple_gate", (P, H), "matrix"),
                layer("per_layer_projection.weight", "ple_proj", (H, P), "matrix"),
                layer("post_per_layer_input_norm.weight", "ple_post_norm", (H,), "norm"),
            ]
        if config.use_layer_scalar:
            specs.append(layer("layer_scalar", "layer_scalar", (1,), "scalar"))
    return specs


def tree_from_leaves(config: ModelConfig, leaves: Mapping[tuple[str | int, ...], Any]) -> Params:
    """Assemble the params pytree from {path: array}; layers become a tuple of dicts."""
    params: dict[str, Any] = {}
    layers: list[dict[str, Any]] = [{} for _ in range(config.num_layers)]
    for path, value in leaves.items():
        if path[0] == "layers":
            layers[path[1]][path[2]] = value
        else:
            params[path[0]] = value
    params["layers"] = tuple(layers)
    return params


def map_params(params: Params, config: ModelConfig, fn: Callable[[ParamSpec, Any], Any]) -> Params:
    """The tree rebuilt with fn(spec, stored form) for every declared parameter; keys that are not
    declared parameters (e.g. a separate "lm_head" form) are carried over unchanged."""
    leaves = {}
    for spec in param_specs(config):
        value: Any = params
        for key in spec.path:
            value = value[key]
        leaves[spec.path] = fn(spec, value)
    rebuilt = tree_from_leaves(config, leaves)
    return {**rebuilt, **{key: params[key] for key in set(params) - set(rebuilt)}}


def abstract_params(config: ModelConfig, weight_dtype: Any = jnp.bfloat16) -> Params:
    """ShapeDtypeStructs for every parameter: shapes of a full-size model without allocating."""
    return tree_from_leaves(
        config, {s.path: jax.ShapeDtypeStruct(s.shape, s.dtype(weight_dtype)) for s in param_specs(config)}
    )


def count_params(tree: Params) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))


def count_bytes(tree: Params) -> int:
    """Bytes of every leaf as stored (quantised leaves count their packed data and scales)."""
    return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def random_params(config: ModelConfig, seed: int = 0, weight_dtype: Any = jnp.float32) -> Params:
    """Random weights for benchmarks and shape tests: N(0, 1/fan_in) matrices and tables drawn directly
    in `weight_dtype` (no float32 copy of a large table), norms and scalars N(1, 0.1) in float32."""
    key, leaves = jax.random.key(seed), {}
    for i, spec in enumerate(param_specs(config)):
        k = jax.random.fold_in(key, i)
        if spec.kind in ("norm", "scalar"):
            leaves[spec.path] = 1.0 + 0.1 * jax.random.normal(k, spec.shape, jnp.float32)
        else:
            fan_in = spec.shape[-1] if spec.kind in ("matrix", "router", "experts") else 1
            dtype = spec.dtype(weight_dtype)
            leaves[spec.path] = jax.random.normal(k, spec.shape, dtype) * jnp.asarray(fan_in**-0.5, dtype)
    return tree_from_leaves(config, leaves)
