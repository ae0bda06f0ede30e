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


@pytest.fixture(autouse=True, scope="session")
def _one_compile_cache_for_the_session(tmp_path_factory):
    """One persistent compilation cache for the whole run of each test process (each pytest-xdist
    worker has its own), empty when it starts: every engine warm-up (in this process or in a `gemmax`
    subprocess, which inherits the environment) reads and writes it, so a program compiled by an
    earlier module or process of the same worker (the same model, dtype and shapes) is loaded instead
    of compiled again, and nothing is written into the user's own cache. Tests about the cache itself
    give their own directory."""
    previous = os.environ.get("GEMMAX_COMPILE_CACHE")
    os.environ["GEMMAX_COMPILE_CACHE"] = str(tmp_path_factory.mktemp("gemmax-cache"))
    yield
    if previous is None:
        os.environ.pop("GEMMAX_COMPILE_CACHE", None)
    else:
        os.environ["GEMMAX_COMPILE_CACHE"] = previous


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_state_after_each_module():
    """Each module starts from a clean JAX process state: the compiled executables earlier modules
    left behind are dropped (`jax.clear_caches`), and the persistent compilation cache that an
    in-process engine turns on for the whole process (`gemmax.engine.compile_cache.enable`, as `serve`
    needs) is turned off again. Without this the full suite aborted inside XLA:CPU (compiling, or
    serialising into the cache) while test_sampling compiled its many small sampler programs late in
    a process holding thousands of executables; neither module alone reproduces it."""
    yield
    import jax
    from jax._src import compilation_cache

    jax.clear_caches()
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
