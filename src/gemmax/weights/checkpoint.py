"""Checkpoint loading: HF safetensors directories (single or sharded), hub ids, and tensor dicts.

Every tensor goes through one explicit map (HF name -> params path, from `params.param_specs`) that
fails with a clear message on a missing, unexpected or mis-shaped tensor. Tensors are read one at a
time and converted to their stored dtype at once, so peak host memory stays near the size of the
weights. The loader counts the bytes it keeps (`Checkpoint.weight_bytes`), the figure `/health` and
`/metrics` report.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

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
    weight_bytes: int
    source: str  # what was loaded (directory, file or hub id)
    directory: Path | None  # where tokenizer / chat template files live, when there is one
    tokenizer: Any = None  # a gemmax.weights.tokenizer.Tokenizer when the file carries one (GGUF)


def read_tensors_safetensors(directory: Path) -> tuple[list[str], Callable[[str], np.ndarray]]:
    """(names, read(name) -> numpy array) over `model.safetensors` or a sharded index."""
    from safetensors import safe_open

    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        with safe_open(directory / "model.safetensors", framework="flax") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {directory}")

    def read(name: str) -> np.ndarray:
        # framework="flax" reads bf16 natively (numpy cannot); one tensor at a time.
        with safe_open(directory / weight_map[name], framework="flax") as f:
            return f.get_tensor(name)

    return sorted(weight_map), read


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


# A Hugging Face hub id: owner/name.
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def hub_fetch(model: str, fetch: Callable[..., str], what: str) -> Path:
    """Run a huggingface_hub fetch (`fetch(local_files_only=...)`) from the cache first, then online;
    a CheckpointError that says so when neither has it."""
    try:
        return Path(fetch(local_files_only=True))
    except Exception:
        pass
    try:
        return Path(fetch(local_files_only=False))
    except Exception as exc:  # offline, gated, missing
        raise CheckpointError(
            f"{what} {model!r} is not in the Hugging Face cache and could not be downloaded ({type(exc).__name__}: {exc})"
        ) from exc


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; otherwise a hub id resolved through huggingface_hub's cache / download."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf" or path.exists():
        raise CheckpointError(f"{model} is not a checkpoint directory")
    if not HUB_ID.fullmatch(str(model)):
        raise CheckpointError(f"model {model!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
    return hub_fetch(str(model), lambda **kw: snapshot_download(str(model), allow_patterns=patterns, **kw), "model")


def load_checkpoint(
    model: str | Path,
    weight_dtype: Any = jnp.bfloat16,
    transform: Callable[[Any, Any], Any] | None = None,
) -> Checkpoint:
    """Load a local HF directory, a hub id, or a `.gguf` file into a params pytree."""
    if str(model).endswith(".gguf"):
        from gemmax.weights.gguf import load_gguf

        return load_gguf(Path(model), weight_dtype=weight_dtype, transform=transform)
    directory = resolve_model_dir(model)
    config = ModelConfig.from_dir(directory)
    names, read = read_tensors_safetensors(directory)
    params, kept = build_params(config, names, read, weight_dtype, transform)
    return Checkpoint(config=config, params=params, weight_bytes=kept, source=str(model), directory=directory)
