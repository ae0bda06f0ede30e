"""The loading path `gemmax serve` runs (gemmax.engine.loading.start_engine): the tokenizer is read
only when first asked for, and `serve` asks for it after the engine's warm-up has started, so that
its GIL-bound parse (1-1.5 s for Gemma's) runs beside the warm-up instead of before it."""

from __future__ import annotations

import pytest

from gemmax.engine import loading
from gemmax.engine.engine import BatchEngine
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
