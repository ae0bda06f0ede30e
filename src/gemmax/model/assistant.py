"""Gemma 4's assistant (MTP drafter, HF `Gemma4AssistantForCausalLM`, `model_type: gemma4_assistant`)
as pure functions over a params pytree and a frozen config.

The assistant is a small Gemma 4 text stack with no KV of its own: every layer reads the target's
shared K/V (the post-k_norm, post-RoPE K and post-v_norm V of the target's last KV-owning full and
sliding layers, gemma4_text_arch.md section 10, "store"). One drafting step for a row whose last
seen token t sits at position p (the target has cached positions [0, p)):

    x = pre_projection(concat(E_target[t] * sqrt(H_target), h))      # [B, 2 * backbone] -> [B, H]
    x = layers(x) at position p: each layer's own Q (q_proj, q_norm, RoPE at p) over the target's
        K/V of its type, bidirectional: full layers see every cached position [0, p), sliding
        layers the last W + 1 of them [p - W - 1, p) (HF's flipped `|q - kv| <= W` window)
    n = final_norm(x)
    logits = n @ E_assistant^T   (no soft-cap)  or, with `use_ordered_embeddings`, the centroid
             masked embedder: only the tokens of the top-k centroids of n get logits
    h' = post_projection(n)                                           # [B, backbone]

`h` is the target's last hidden state after its final norm (HF `hidden_states[-1]`, tied to
`last_hidden_state`) at the position that produced t, for the first step; each further step feeds
the token just drafted and the assistant's own h', at the same position p (transformers'
`SinglePositionMultiTokenCandidateGenerator`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from gemmax.model.config import ConfigError, LayerSpec, ModelConfig
from gemmax.model.forward import Keys, apply_rope, attend, rope_inv_freq
from gemmax.model.linear import linear, lookup
from gemmax.model.ops import gelu_tanh, rms_norm
from gemmax.model.params import Params, ParamSpec, param_specs


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """The assistant's text stack (every layer "reuse": it owns no K/V) and its projections."""

    text: ModelConfig
    backbone_hidden_size: int  # the target's hidden size H_target
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> AssistantConfig:
        if hf.get("model_type") != "gemma4_assistant":
            raise ConfigError(f"model_type {hf.get('model_type')!r} is not an MTP assistant (gemma4_assistant)")
        text = dict(hf["text_config"])
        for field, allowed in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False),
                               ("use_double_wide_mlp", False)):
            if text.get(field, allowed) not in (allowed, None):
                raise ConfigError(f"gemma4_assistant: text_config.{field} must be {allowed}, got {text[field]}")
        num_layers = int(text["num_hidden_layers"])
        if int(text.get("num_kv_shared_layers") or num_layers) != num_layers:
            raise ConfigError("gemma4_assistant: every layer must read the target's shared K/V "
                              f"(num_kv_shared_layers {text['num_kv_shared_layers']} != {num_layers} layers)")
        # Parsed as a KV-owning stack, then every layer marked "reuse" (its donor: the target's layer).
        parsed = ModelConfig.from_hf_config({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0,
                                             "hidden_size_per_layer_input": 0})
        layers = tuple(dataclasses.replace(spec, kv_mode="reuse", kv_donor=-1) for spec in parsed.layers)
        config = cls(text=dataclasses.replace(parsed, layers=layers),
                     backbone_hidden_size=int(hf.get("backbone_hidden_size", 1536)),
                     use_ordered_embeddings=bool(hf.get("use_ordered_embeddings", False)),
                     num_centroids=int(hf.get("num_centroids", 2048)),
                     centroid_intermediate_top_k=int(hf.get("centroid_intermediate_top_k", 32)))
        if config.use_ordered_embeddings and config.text.vocab_size % config.num_centroids:
            raise ConfigError(f"gemma4_assistant: vocab_size {config.text.vocab_size} is not a multiple of "
                              f"num_centroids {config.num_centroids}")
        return config

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(spec.attention_type for spec in self.text.layers)


def assistant_param_specs(config: AssistantConfig) -> list[ParamSpec]:
    """The text stack's specs (HF names under `model.`; no K/V weights: every layer reuses) and the
    projections / masked embedder (HF names at the top level, marked by a leading "/")."""
    H, Hb = config.text.hidden_size, config.backbone_hidden_size
    specs = param_specs(config.text)
    specs += [
        ParamSpec("/pre_projection.weight", ("pre_projection",), (H, 2 * Hb), "matrix"),
        ParamSpec("/post_projection.weight", ("post_projection",), (Hb, H), "matrix"),
    ]
    if config.use_ordered_embeddings:
        specs += [
            ParamSpec("/masked_embedding.centroids.weight", ("centroids",), (config.num_centroids, H), "matrix"),
            ParamSpec("/masked_embedding.token_ordering", ("token_ordering",), (config.text.vocab_size,), "scalar"),
        ]
    return specs


def target_kv_donors(target: ModelConfig) -> dict[str, int]:
    """The target layer whose K/V the assistant reads, per layer type: the last KV-owning layer of
    that type (HF marks it "store" even when no target layer reuses it)."""
    return {t: max(i for i, spec in enumerate(target.layers) if spec.owns_kv and spec.attention_type == t)
            for t in {spec.attention_type for spec in target.layers}}


def check_assistant(target: ModelConfig, config: AssistantConfig) -> list[str]:
    """Why this assistant cannot draft for this target (empty: it can)."""
    problems = []
    if target.family != "gemma4":
        problems.append(f"the target is {target.family}, an MTP assistant drafts for Gemma 4 targets only")
        return problems
    if config.backbone_hidden_size != target.hidden_size:
        problems.append(f"the assistant was trained on a {config.backbone_hidden_size}-wide backbone, the target's "
                        f"hidden size is {target.hidden_size}")
    if config.text.vocab_size != target.vocab_size:
        problems.append(f"the assistant's vocabulary has {config.text.vocab_size:,} tokens, the target's "
                        f"{target.vocab_size:,}")
    donors = target_kv_donors(target)
    for i, spec in enumerate(config.text.layers):
        donor = donors.get(spec.attention_type)
        if donor is None:
            problems.append(f"assistant layer {i} reads {spec.attention_type} K/V, the target has no such layer")
            continue
        d = target.layers[donor]
        if (d.head_dim, d.num_kv_heads) != (spec.head_dim, spec.num_kv_heads):
            problems.append(f"assistant layer {i} ({spec.attention_type}) expects K/V of {spec.num_kv_heads} heads x "
                            f"{spec.head_dim}, target layer {donor} has {d.num_kv_heads} x {d.head_dim}")
        if spec.sliding_window is not None and spec.sliding_window > (d.sliding_window or 0):
            problems.append(f"assistant layer {i} has a window of {spec.sliding_window}, the target's "
                            f"sliding layers {d.sliding_window}")
    return problems


# ------------------------------------------------------------------------------------------ forward
def _layer(layer: Params, x: jax.Array, spec: LayerSpec, config: ModelConfig, position: jax.Array,
           kv: Keys) -> jax.Array:
    """One assistant decoder layer for one query per row: x [B, 1, H] -> [B, 1, H]."""
    eps = config.rms_norm_eps
    B = x.shape[0]
    nh, hd = config.num_attention_heads, spec.head_dim
    a = rms_norm(x, layer["input_norm"], eps)
    q = linear(a, layer["q"]).reshape(B, 1, nh, hd)
    q = apply_rope(rms_norm(q, layer["q_norm"], eps), position[:, None], rope_inv_freq(config, spec))
    visible = kv.key_valid & (kv.key_pos < position[:, None])
    if spec.sliding_window is not None:
        visible &= kv.key_pos >= position[:, None] - spec.sliding_window - 1
    out = attend(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), visible[:, None, :], config.attention_scale)
    a = linear(out.reshape(B, 1, nh * hd), layer["o"])
    h = x + rms_norm(a, layer["post_attn_norm"], eps)
    m = rms_norm(h, layer["pre_ffn_norm"], eps)
    m = linear(gelu_tanh(linear(m, layer["gate"])) * linear(m, layer["up"]), layer["down"])
    h = h + rms_norm(m, layer["post_ffn_norm"], eps)
    if config.use_layer_scalar:
        h = h * layer["layer_scalar"].astype(h.dtype)
    return h


def masked_logits(params: Params, n: jax.Array, config: AssistantConfig) -> jax.Array:
    """The centroid masked embedder: n [B, H] -> logits [B, V] f32, real only for the tokens of the
    top-k centroids of n; every other token gets the row's smallest real logit minus 1 (HF: the
    smallest over the whole batch, which only differs for several rows)."""
    V, C, K = config.text.vocab_size, config.num_centroids, config.centroid_intermediate_top_k
    _, top = jax.lax.top_k(linear(n, params["centroids"]).astype(jnp.float32), K)  # [B, K]
    clusters = params["token_ordering"].astype(jnp.int32).reshape(C, V // C)
    chosen = clusters[top].reshape(n.shape[0], K * (V // C))  # [B, K * V/C] token ids
    rows = lookup(params["embed"], chosen, n.dtype)  # [B, K * V/C, H]
    picked = jnp.einsum("bh,bth->bt", n, rows, preferred_element_type=jnp.float32)
    fill = jnp.min(picked, axis=-1, keepdims=True) - 1.0
    full = jnp.broadcast_to(fill, (n.shape[0], V))
    return full.at[jnp.arange(n.shape[0])[:, None], chosen].set(picked)


def assistant_step(params: Params, config: AssistantConfig, token_embeds: jax.Array, hidden: jax.Array,
                   position: jax.Array, shared: Mapping[str, Keys]) -> tuple[jax.Array, jax.Array]:
    """One drafting step (module docstring): token_embeds [B, Hb] (the target's scaled embedding of
    the last seen token), hidden [B, Hb], position [B] (the last seen token's), shared {layer type:
    the target's K/V}. Returns (logits [B, V] f32, the next step's hidden [B, Hb])."""
    text = config.text
    x = linear(jnp.concatenate([token_embeds, hidden.astype(token_embeds.dtype)], axis=-1), params["pre_projection"])
    x = x[:, None, :]  # [B, 1, H]
    for i, spec in enumerate(text.layers):
        with jax.named_scope(f"assistant_layer_{i}"):
            x = _layer(params["layers"][i], x, spec, text, position, shared[spec.attention_type])
    n = rms_norm(x[:, 0], params["final_norm"], text.rms_norm_eps)  # [B, H]
    if config.use_ordered_embeddings:
        logits = masked_logits(params, n, config)
    else:
        logits = linear(n, params["embed"]).astype(jnp.float32)
    return logits, linear(n, params["post_projection"])

