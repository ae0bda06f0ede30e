"""Gemma 4 MTP assistant checkpoints (`Gemma4AssistantForCausalLM`, `model_type: gemma4_assistant`):
an HF safetensors directory (or a hub id) read through the same tensor reader and HF-name map as a
target (`read_tensors`, `build_params`) for the text stack under `model.`, plus the top-level
projections and masked embedder of `gemmax.model.assistant.assistant_param_specs`. Missing,
unexpected and mis-shaped tensors fail with their names, as for a target."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from gemmax.model.assistant import AssistantConfig, assistant_param_specs
from gemmax.model.params import Params, count_bytes
from gemmax.weights.checkpoint import CheckpointError, build_params
from gemmax.weights.safetensors import read_tensors
from gemmax.weights.source import HUB_ID, hub_fetch

_TEXT_PREFIX = "model."
_PATTERNS = ["*.json", "*.safetensors"]


@dataclasses.dataclass(frozen=True)
class AssistantCheckpoint:
    config: AssistantConfig
    params: Params
    weight_bytes: int
    name: str


def assistant_directory(model: str | Path) -> Path:
    """A local directory as it is; a hub id from the Hugging Face cache (downloaded when online)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not HUB_ID.fullmatch(str(model)):
        raise CheckpointError(f"assistant {str(model)!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    return hub_fetch(str(model), lambda **kw: snapshot_download(str(model), allow_patterns=_PATTERNS, **kw),
                     "assistant")


def read_config(model: str | Path) -> dict | None:
    """The config.json of a local directory or hub id (only that file is fetched); None if it has none."""
    path = Path(model).expanduser()
    if path.is_dir():
        file = path / "config.json"
        return json.loads(file.read_text()) if file.is_file() else None
    if not HUB_ID.fullmatch(str(model)):
        return None
    from huggingface_hub import hf_hub_download

    file = hub_fetch(str(model), lambda **kw: hf_hub_download(str(model), "config.json", **kw), "config.json of")
    return json.loads(Path(file).read_text())


def is_assistant(model: str | Path) -> bool:
    """Whether `model` (a `--draft-model`) is a Gemma 4 MTP assistant rather than a draft model."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return False
    config = read_config(model)
    return config is not None and config.get("model_type") == "gemma4_assistant"


def assistant_weight_bytes(config: AssistantConfig, weight_dtype: Any) -> int:
    """Bytes the loaded assistant keeps, from its declared shapes (for `gemmax fit`)."""
    return sum(int(np.prod(s.shape)) * jnp.dtype(jnp.int32 if s.path == ("token_ordering",) else s.dtype(weight_dtype)).itemsize
               for s in assistant_param_specs(config))


def load_assistant(model: str | Path, weight_dtype: Any = jnp.bfloat16) -> AssistantCheckpoint:
    directory = assistant_directory(model)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {directory}")
    config = AssistantConfig.from_hf_config(json.loads(config_file.read_text()))
    names, read = read_tensors(directory)
    text_names = [n for n in names if n.startswith(_TEXT_PREFIX)]
    params, kept = build_params(config.text, text_names, read, weight_dtype)
    extras = {s.hf_name[1:]: s for s in assistant_param_specs(config) if s.hf_name.startswith("/")}
    unexpected = [n for n in names if not n.startswith(_TEXT_PREFIX) and n not in extras and n != "lm_head.weight"]
    if unexpected:  # lm_head.weight: the tied head, saved anyway
        raise CheckpointError(f"unexpected tensors in assistant checkpoint: {', '.join(unexpected[:8])}")
    missing = [n for n in extras if n not in names]
    if missing:
        raise CheckpointError(f"missing tensors in assistant checkpoint: {', '.join(missing)}")
    for name, spec in extras.items():
        tensor = read(name)
        if tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, config expects {spec.shape}")
        # token_ordering holds token ids (int64 in the file)
        dtype = jnp.int32 if spec.path == ("token_ordering",) else spec.dtype(weight_dtype)
        value = jnp.asarray(tensor).astype(dtype)
        params[spec.path[0]] = value
        kept += count_bytes(value)
    return AssistantCheckpoint(config=config, params=params, weight_bytes=kept, name=str(model))
