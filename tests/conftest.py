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


@pytest.fixture(autouse=True, scope="module")
def _persistent_compile_cache_off_after_each_module():
    """An engine started in-process turns JAX's persistent compilation cache on for the whole process
    (`gemmax.engine.compile_cache.enable`, as `serve` needs). Turn it off after each module, so later
    modules that jit their own functions do not serialise every one of them into whatever directory an
    earlier module left configured: the full suite aborted twice inside XLA:CPU's executable
    serialisation (jax's `put_executable_and_time`) while test_sampling compiled its many small
    sampler programs with the cache left on, which neither module alone reproduces."""
    yield
    import jax
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
