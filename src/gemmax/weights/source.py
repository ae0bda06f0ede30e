"""A `--model` argument resolved once into a `ModelSource`: what it is, where it lives, its config,
whether its matrices are stored quantised, how to read its tensors and its tokenizer.

`gemmax.weights.load.open_source` builds one (the only place a `--model` string is classified); the
config loading of `fit`, `--quant auto`, the memory plan and the weight loader all read the same
object, so a GGUF is opened once, a config parsed once, and the hub asked once.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from gemmax.model.config import ModelConfig
from gemmax.weights.checkpoint import CheckpointError

if TYPE_CHECKING:
    from gemmax.weights.tokenizer import Tokenizer

# (HF tensor names, read(name) -> numpy array in HF layout)
TensorIndex = tuple[list[str], Callable[[str], np.ndarray]]

# A Hugging Face hub id: owner/name.
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str  # what was asked for (the built-in model: its converted directory)
    kind: Literal["safetensors", "gguf", "config"]  # "config": a config.json alone, no weights
    path: Path  # the HF directory, the .gguf file or the config.json
    config: ModelConfig
    stored_quantized: bool  # matrices stored at 8 bits or fewer (a Q4_K_M / Q8_0 GGUF, the built-in model)
    tensors: Callable[[], TensorIndex] | None = None  # opens the weights; None for kind "config"
    open_tokenizer: Callable[[], Tokenizer | None] | None = None  # None: no tokenizer

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        """Loaded on first use: Gemma's 262,144-entry tokenizer takes 1-1.5 s and holds the GIL
        throughout, so `gemmax serve` asks for it only once the engine's warm-up runs beside it
        (`gemmax.engine.loading.start_engine`). An HF directory reads its files then; a GGUF's
        tokenizer is built when the file is opened (`gguf_source`) and only handed over here."""
        return None if self.open_tokenizer is None else self.open_tokenizer()

    @property
    def directory(self) -> Path | None:
        """Where tokenizer and chat-template files live, for an HF directory."""
        return self.path if self.kind == "safetensors" else None


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
