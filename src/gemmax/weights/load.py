"""The two entry points of the weights layer: `open_source` classifies a `--model` argument once, and
`load_checkpoint` reads a source's tensors through the one HF-name map into a params pytree.

A `--model` is a local HF directory (single or sharded safetensors; `Gemma4ForCausalLM` or the
multimodal layout, of which only the text decoder is loaded), a `.gguf` file, a `config.json` or a
directory holding only one (config only: `gemmax fit`), a hub id (read from the Hugging Face cache,
downloaded when online), or None for the built-in model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from gemmax.model.config import ModelConfig
from gemmax.weights import builtin
from gemmax.weights.checkpoint import Checkpoint, CheckpointError, build_params
from gemmax.weights.gguf import gguf_source
from gemmax.weights.safetensors import directory_source
from gemmax.weights.source import HUB_ID, ModelSource, hub_fetch

# What a hub snapshot needs for serving: config, weights, tokenizer and chat template.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def open_source(model: str | Path | None, *, weights: bool = True) -> ModelSource:
    """Resolve `model` once. `weights=False` asks for the config alone (a hub id then fetches only its
    config.json, and a config.json file is accepted); no tokenizer is loaded then."""
    if model is None:
        model = builtin.default_model_path()
    name = str(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return gguf_source(name, path)
    if path.is_dir():
        return _directory(name, path, weights)
    if path.is_file():
        if weights:
            raise CheckpointError(f"{model} is not a checkpoint directory")
        return ModelSource(name=name, kind="config", path=path, stored_quantized=False,
                           config=ModelConfig.from_hf_config(json.loads(path.read_text())))
    if not HUB_ID.fullmatch(name):
        accepted = "a local directory nor a hub id" if weights else "a local directory, a config.json, a .gguf nor a hub id"
        raise CheckpointError(f"model {name!r} is neither {accepted} (owner/name)")
    if weights:
        from huggingface_hub import snapshot_download

        directory = hub_fetch(name, lambda **kw: snapshot_download(name, allow_patterns=HUB_PATTERNS, **kw), "model")
        return _directory(name, directory, weights)
    from huggingface_hub import hf_hub_download

    file = hub_fetch(name, lambda **kw: hf_hub_download(name, "config.json", **kw), "config.json of")
    return ModelSource(name=name, kind="config", path=file, stored_quantized=False,
                       config=ModelConfig.from_hf_config(json.loads(file.read_text())))


def _directory(name: str, directory: Path, weights: bool) -> ModelSource:
    return directory_source(name, directory, stored_quantized=builtin.converted_from_quantized(directory),
                            with_tokenizer=weights)


def load_checkpoint(
    model: ModelSource | str | Path,
    weight_dtype: Any = jnp.bfloat16,
    transform: Callable[[Any, Any], Any] | None = None,
) -> Checkpoint:
    """Read a source's tensors into a params pytree (`model` not yet a ModelSource is opened first).
    `transform(spec, array)` may replace each tensor as it loads (quantisation at load)."""
    source = model if isinstance(model, ModelSource) else open_source(model)
    if source.tensors is None:
        raise CheckpointError(f"{source.name} holds a config only, no weights")
    names, read = source.tensors()
    params, kept = build_params(source.config, names, read, weight_dtype, transform)
    return Checkpoint(config=source.config, params=params, weight_bytes=kept, source=source)
