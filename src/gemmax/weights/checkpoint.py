"""The loaded checkpoint and the one map from HF tensor names to the params pytree, shared by every
format (safetensors directories, GGUF files).

Every tensor goes through one explicit map (HF name -> params path, from `params.param_specs`) that
fails with a clear message on a missing, unexpected or mis-shaped tensor. Tensors are read one at a
time and converted to their stored dtype at once, so peak host memory stays near the size of the
weights. The loader counts the bytes it keeps (`Checkpoint.weight_bytes`), the figure `/health` and
`/metrics` report.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from gemmax.model.config import ModelConfig
from gemmax.model.params import Params, count_bytes, param_specs, tree_from_leaves

# Prefixes of the text decoder in the layouts transformers writes, most specific first.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Towers and projections of multimodal checkpoints: not part of the text decoder.
NON_TEXT = re.compile(r"^(model\.)?(vision_tower|audio_tower|multi_modal_projector|embed_vision|embed_audio)\.")
# K/V weights that KV-sharing ("reuse") layers carry in some hub files but never use.
UNUSED_SHARED_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight", "self_attn.v_norm.weight")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, with the tensor named."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    params: Params
    weight_bytes: int  # bytes of the params kept (after any load-time quantisation)
    source: Any  # the gemmax.weights.source.ModelSource it was loaded from


def build_params(
    config: ModelConfig,
    names: list[str],
    read: Callable[[str], Any],
    weight_dtype: Any = jnp.bfloat16,
    transform: Callable[[Any, Any], Any] | None = None,
) -> tuple[Params, int]:
    """Map HF tensor names onto the params pytree; returns (params, bytes kept).

    `transform(spec, array)` may replace a converted tensor (quantisation at load); its output's bytes
    are what is counted.
    """
    prefix = _text_prefix(names)
    specs = {s.hf_name: s for s in param_specs(config)}
    reuse_layers = {i for i, spec in enumerate(config.layers) if not spec.owns_kv}
    leaves: dict[tuple, Any] = {}
    unexpected = []
    kept_bytes = 0
    for name in names:
        if not name.startswith(prefix):
            if NON_TEXT.match(name) or name == "lm_head.weight":  # towers; tied head saved anyway
                continue
            unexpected.append(name)
            continue
        short = name[len(prefix) :]
        spec = specs.get(short)
        if spec is None:
            if _is_unused_shared_kv(short, reuse_layers) or NON_TEXT.match(short):
                continue
            unexpected.append(name)
            continue
        tensor = read(name)
        if tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, config expects {spec.shape}")
        value = jnp.asarray(tensor).astype(jnp.float32 if config.norm_adds_one and spec.kind == "norm" else spec.dtype(weight_dtype))
        if config.norm_adds_one and spec.kind == "norm":
            value = value + 1.0  # Gemma 3 RMSNorm scales by (1 + w): fold the 1 in once, in fp32
        if transform is not None:
            value = transform(spec, value)
        del tensor
        leaves[spec.path] = value
        kept_bytes += count_bytes(value)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        raise CheckpointError(f"unexpected tensors in checkpoint: {shown}")
    missing = [s.hf_name for s in specs.values() if s.path not in leaves]
    if missing:
        shown = ", ".join(prefix + m for m in missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"missing tensors in checkpoint: {shown}")
    return tree_from_leaves(config, leaves), kept_bytes


def _text_prefix(names: list[str]) -> str:
    for prefix in TEXT_PREFIXES:
        if any(n.startswith(prefix + "embed_tokens.") for n in names):
            return prefix
    raise CheckpointError("no text decoder found: expected model.embed_tokens.weight or model.language_model.embed_tokens.weight")


def _is_unused_shared_kv(short: str, reuse_layers: set[int]) -> bool:
    match = re.match(r"layers\.(\d+)\.(.+)$", short)
    return bool(match) and int(match.group(1)) in reuse_layers and match.group(2) in UNUSED_SHARED_KV
