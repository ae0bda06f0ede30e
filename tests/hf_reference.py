"""Small random Gemma checkpoints built with transformers (the reference we did not write).

Each config switches on a different mix of Gemma 4 features; norm weights and layer_scalar are
randomised (N(1, 0.5)) so a (1 + w) mistake or a missing scalar shows. Checkpoints are saved with
`save_pretrained` and loaded by gemmax's real loader.
"""

from __future__ import annotations

from pathlib import Path

import torch

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE4 = {
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    SLIDING: {"rope_type": "default", "rope_theta": 1e4},
}

GEMMA4_CONFIGS = {
    # spec §18 recipe: sliding + full, window 4, KV sharing with both donor types, double-wide MLP,
    # heterogeneous head dims (16 / 32), proportional RoPE, PLE, softcap.
    "g4_shared": dict(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL, FULL], num_kv_shared_layers=3,
        use_double_wide_mlp=True, hidden_size_per_layer_input=8, sliding_window=4,
        final_logit_softcapping=30.0, rope_parameters=ROPE4,
    ),
    # attention_k_eq_v with num_global_key_value_heads on full layers, KV sharing, PLE, softcap.
    "g4_k_eq_v": dict(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, intermediate_size=80,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        attention_k_eq_v=True, num_global_key_value_heads=1,
        layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL], num_kv_shared_layers=2,
        use_double_wide_mlp=False, hidden_size_per_layer_input=8, sliding_window=5,
        final_logit_softcapping=30.0, rope_parameters=ROPE4,
    ),
    # no PLE, no KV sharing, no softcap, MQA, default RoPE with linear factor on full layers.
    "g4_plain": dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, global_head_dim=24,
        layer_types=[SLIDING, SLIDING, FULL, FULL], num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, sliding_window=3, final_logit_softcapping=None,
        rope_parameters={FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4, "factor": 2.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}},
    ),
}

# The rest of the family, shaped like the real models at toy width (8 query heads, so a tp=8 mesh
# splits every layer's heads): tests/test_family_parity.py and the mesh tests. Not built by the
# session-wide `hf_checkpoints` fixture.
FAMILY_CONFIGS = {
    # E4B: the E2B code path (PLE, KV sharing) with several KV heads and no double-wide MLP.
    "e4b_like": dict(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL], num_kv_shared_layers=2,
        use_double_wide_mlp=False, hidden_size_per_layer_input=8, sliding_window=4,
        final_logit_softcapping=30.0, rope_parameters=ROPE4,
    ),
    # 31B: no PLE, no KV sharing, attention_k_eq_v with fewer global KV heads, "vision" bidirectional.
    "31b_like": dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, global_head_dim=16,
        attention_k_eq_v=True, num_global_key_value_heads=2,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL], num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, sliding_window=4, use_bidirectional_attention="vision",
        final_logit_softcapping=30.0, rope_parameters=ROPE4,
    ),
    # 26B-A4B: the 31B attention plus, in every layer, a dense MLP and 8 experts (top 2).
    "26b_a4b_like": dict(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, global_head_dim=16,
        attention_k_eq_v=True, num_global_key_value_heads=2,
        layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, sliding_window=4, final_logit_softcapping=30.0, rope_parameters=ROPE4,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16,
    ),
}

GEMMA3_CONFIGS = {
    "g3_small": dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                         FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
    ),
}


def randomize_norms(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                tensor.copy_(torch.normal(1.0, 0.5, tensor.shape, generator=gen))


def randomize_moe(model: torch.nn.Module, seed: int) -> None:
    """MoE norms (`..._1` / `..._2`), router scales and per-expert scales around 1, the router
    projection wide enough that the top-k choice is clear-cut (no near-ties between experts)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("layernorm_1.weight", "layernorm_2.weight", "router.scale", "router.per_expert_scale")):
                tensor.copy_(torch.normal(1.0, 0.5, tensor.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                tensor.copy_(torch.normal(0.0, 1.0, tensor.shape, generator=gen))
            elif ".experts." in name:
                tensor.copy_(torch.normal(0.0, tensor.shape[-1] ** -0.5, tensor.shape, generator=gen))


def build_gemma4(name: str, directory: Path, seed: int = 0, configs: dict | None = None):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    config = Gemma4TextConfig(**(configs or GEMMA4_CONFIGS)[name], attn_implementation="eager")
    model = Gemma4ForCausalLM(config).eval()
    randomize_norms(model, seed)
    if config.enable_moe_block:
        randomize_moe(model, seed)
    model.save_pretrained(directory)
    return model


def build_gemma3(name: str, directory: Path, seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(**GEMMA3_CONFIGS[name], attn_implementation="eager")
    model = Gemma3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # Gemma 3 norms are (1 + w) with w initialised to 0: randomise w around 0
        for pname, tensor in model.named_parameters():
            if pname.endswith("norm.weight"):
                tensor.copy_(torch.normal(0.0, 0.5, tensor.shape, generator=gen))
    model.save_pretrained(directory)
    return model
