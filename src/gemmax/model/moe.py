"""The Gemma 4 mixture-of-experts block (26B-A4B, spec section 12), next to the dense MLP of a layer.

    z      = RMSNorm_noscale(r) * router_scale * H^-1/2             r: the residual after attention
    p      = softmax_f32(z @ W_router^T)                            [N, E]
    w, idx = top_k(p, k); w /= sum(w); w *= expert_scale[idx]       [N, k]
    x      = RMSNorm_pre_ffn_2(r)
    y      = sum_j w_j * down[idx_j] @ (gelu_tanh(gate[idx_j] @ x) * (up[idx_j] @ x))

The experts run batched, never in a Python loop over experts, in one of two forms picked from the
static token count:
- **gather** (N * k <= E, i.e. decode, one device or no ep axis): each token's k experts' weights are
  gathered ([N, k, 2*Im, H]) and multiplied; a decode step reads only the experts its tokens chose;
- **dense** (prefill chunks): every expert runs on every token ([N, E, 2*Im]) and a combine matrix
  [N, E] (the top-k weights, zero elsewhere) sums them. It costs E / k times the useful FLOPs but no
  per-token copy of the weights, and on an expert-parallel mesh (always taken there: a gather from
  experts split over ep would move gathered weights between devices) each device computes its own
  experts and one all-reduce of [N, H] sums them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gemmax.model.config import ModelConfig
from gemmax.model.ops import gelu_tanh, rms_norm


def route(layer: dict, r: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Router: r [N, H] -> (weights [N, k] float32, expert ids [N, k] int32)."""
    z = rms_norm(r, None, config.rms_norm_eps) * layer["router_scale"].astype(r.dtype) * config.hidden_size**-0.5
    w = layer["router"]
    scores = lax.dot_general(z.astype(w.dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1)  # [N, E]
    top_w, top_i = lax.top_k(probs, config.top_k_experts)
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w * layer["expert_scale"].astype(jnp.float32)[top_i], top_i


def moe_block(layer: dict, r: jax.Array, config: ModelConfig) -> jax.Array:
    """r [B, T, H] (the residual stream after attention) -> the experts' weighted sum [B, T, H]
    (before post_feedforward_layernorm_2)."""
    B, T, H = r.shape
    flat = r.reshape(B * T, H)
    with jax.named_scope("router"):
        top_w, top_i = route(layer, flat, config)
    x = rms_norm(flat, layer["pre_ffn_norm_2"], config.rms_norm_eps)
    gate_up, down = layer["experts_gate_up"], layer["experts_down"]  # [E, 2Im, H], [E, H, Im]
    x = x.astype(gate_up.dtype)
    Im = config.moe_intermediate_size
    f32 = jnp.float32
    mesh = jax.sharding.get_abstract_mesh()
    expert_parallel = not mesh.empty and mesh.shape.get("ep", 1) > 1
    if flat.shape[0] * config.top_k_experts <= config.num_experts and not expert_parallel:
        with jax.named_scope("experts_gather"):
            h = jnp.einsum("nh,nkih->nki", x, gate_up[top_i], preferred_element_type=f32)  # [N, k, 2Im]
            a = (gelu_tanh(h[..., :Im]) * h[..., Im:]).astype(down.dtype)
            y = jnp.einsum("nki,nkhi->nkh", a, down[top_i], preferred_element_type=f32)  # [N, k, H]
            out = jnp.einsum("nkh,nk->nh", y, top_w)
    else:
        with jax.named_scope("experts_dense"):
            rows = jnp.arange(flat.shape[0])[:, None]
            combine = jnp.zeros((flat.shape[0], config.num_experts), f32).at[rows, top_i].add(top_w)  # [N, E]
            h = jnp.einsum("nh,eih->nei", x, gate_up, preferred_element_type=f32)  # [N, E, 2Im]
            a = (gelu_tanh(h[..., :Im]) * h[..., Im:] * combine[..., None]).astype(down.dtype)
            out = jnp.einsum("nei,ehi->nh", a, down, preferred_element_type=f32)
    return out.astype(r.dtype).reshape(B, T, H)
