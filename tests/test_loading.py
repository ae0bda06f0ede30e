"""The loading path `gemmax serve` runs (gemmax.engine.loading.start_engine): the tokenizer is read
only when first asked for, and `serve` asks for it after the engine's warm-up has started, so that
its GIL-bound parse (1-1.5 s for Gemma's) runs beside the warm-up instead of before it; the
persistent compilation cache is on before the weights load, so the programs loading compiles are
read back by the next start."""

from __future__ import annotations

import jax
import pytest
from jax import monitoring
from jax._src import compilation_cache as jax_compilation_cache

from gemmax.engine import compile_cache, loading
from gemmax.engine.engine import BatchEngine
from gemmax.quant.options import QuantOptions
from gemmax.weights import safetensors
from gemmax.weights.load import open_source
from tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def events(monkeypatch):
    """Records when a tokenizer is read and when an engine's warm-up starts (the warm-up itself is not
    run: these tests are about the order, and the engine's own tests warm it up)."""
    seen = []
    read = safetensors.load_tokenizer

    def load_tokenizer(directory):
        seen.append("tokenizer read")
        return read(directory)

    def start(engine, background=True):
        seen.append("warm-up started")
        return engine

    monkeypatch.setattr(safetensors, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(BatchEngine, "start", start)
    return seen


def test_a_source_reads_its_tokenizer_once_and_only_when_asked(checkpoint, events):
    source = open_source(str(checkpoint))
    assert events == []
    tokenizer = source.tokenizer
    assert tokenizer is not None and tokenizer.encode("Hello world")
    assert source.tokenizer is tokenizer and events == ["tokenizer read"]
    assert open_source(str(checkpoint), weights=False).tokenizer is None  # a config is all that was asked for
    assert events == ["tokenizer read"]


def test_serve_reads_the_tokenizer_after_the_warm_up_has_started(checkpoint, events):
    engine, tokenizer = loading.start_engine(str(checkpoint), "float32", None, max_model_len=64, max_batch=1,
                                             buckets=(16,), prefix_cache_bytes=0)
    assert events == ["warm-up started", "tokenizer read"]
    assert tokenizer is not None and tokenizer.decode(tokenizer.encode("Hello world")).strip() == "Hello world"


def test_a_tokenizer_that_does_not_load_stops_the_engine_it_followed(checkpoint, events, monkeypatch):
    def broken(directory):
        raise ValueError("tokenizer.json: not a tokenizer")

    stopped = []
    monkeypatch.setattr(safetensors, "load_tokenizer", broken)
    monkeypatch.setattr(BatchEngine, "shutdown", lambda engine, drain_timeout=30.0: stopped.append(drain_timeout))
    with pytest.raises(ValueError, match="not a tokenizer"):
        loading.start_engine(str(checkpoint), "float32", None, max_model_len=64, max_batch=1, buckets=(16,),
                             prefix_cache_bytes=0)
    assert events == ["warm-up started"] and stopped == [0]


def test_the_weights_load_with_the_compile_cache_on_and_the_next_start_reads_it(checkpoint, events, tmp_path):
    """Loading compiles small programs of its own (dtype conversions, int8 quantisation: 31 for the
    built-in model, 1.3 s of XLA): `start_engine` turns the persistent cache on before the weights
    load, in the directory the warm-up uses, so the next start reads them back instead."""
    directory = tmp_path / "xla"

    def start() -> compile_cache.Tracker:
        jax.clear_caches()  # nothing held in this process's memory: each program compiles or is read back,
        jax_compilation_cache.reset_cache()  # from `directory` (JAX opens its cache once per process)
        tracker = compile_cache.Tracker(directory)
        monitoring.register_event_listener(tracker)
        try:
            loading.start_engine(str(checkpoint), "float32", QuantOptions(quant="int8"), max_model_len=64,
                                 max_batch=1, buckets=(16,), prefix_cache_bytes=0, compile_cache_dir=str(directory))
        finally:
            monitoring.unregister_event_listener(tracker)
        return tracker

    first = start()
    written = sorted(path.name for path in directory.glob(f"*{compile_cache.ENTRY_SUFFIX}"))
    assert events == ["warm-up started", "tokenizer read"]  # the warm-up did not run (`events`)
    assert any(name.startswith("jit_int8_rows") for name in written), written  # the quantiser's
    assert first.misses == len(written) and first.hits == 0
    again = start()
    assert again.misses == 0 and again.hits > 0  # (jax.clear_caches leaves a jitted function or two in memory)
    assert sorted(path.name for path in directory.glob(f"*{compile_cache.ENTRY_SUFFIX}")) == written
