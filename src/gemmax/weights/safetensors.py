"""Hugging Face checkpoint directories: `config.json`, `model.safetensors` (or a sharded index) and the
tokenizer files. Also the built-in model's converted directory, whose marker file says whether the
GGUF it came from stored its matrices quantised (`builtin.converted_from_quantized`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from gemmax.model.config import ModelConfig
from gemmax.weights.checkpoint import CheckpointError
from gemmax.weights.source import ModelSource, TensorIndex
from gemmax.weights.tokenizer import load_tokenizer


def directory_source(name: str, directory: Path, *, stored_quantized: bool, with_tokenizer: bool = True) -> ModelSource:
    """A ModelSource over an HF directory: its config now, its tensors when `tensors()` opens them and,
    `with_tokenizer`, its tokenizer when first asked for."""
    return ModelSource(name=name, kind="safetensors", path=directory, config=ModelConfig.from_dir(directory),
                       stored_quantized=stored_quantized, tensors=lambda: read_tensors(directory),
                       open_tokenizer=(lambda: load_tokenizer(directory)) if with_tokenizer else None)


def read_tensors(directory: Path) -> TensorIndex:
    """(names, read(name) -> numpy array) over `model.safetensors` or a sharded index."""
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
