"""Shared fixtures: tiny random HF checkpoints built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
sys.path.insert(0, str(Path(__file__).parent))

from hf_reference import GEMMA3_CONFIGS, GEMMA4_CONFIGS, build_gemma3, build_gemma4  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """{name: (directory, transformers model)} for every reference config, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    built = {}
    for name in GEMMA4_CONFIGS:
        built[name] = (root / name, build_gemma4(name, root / name, seed=len(built)))
    for name in GEMMA3_CONFIGS:
        built[name] = (root / name, build_gemma3(name, root / name, seed=len(built)))
    return built


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The tiny checkpoints' tokenizer (tiny_checkpoint.write_tokenizer), for the fake-engine servers."""
    from gemmax.weights.tokenizer import load_tokenizer
    from tiny_checkpoint import write_tokenizer

    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))
