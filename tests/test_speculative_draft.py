"""Speculative decoding with a draft model, apart from the engine runs (those share the engine of
tests/test_speculative.py): the rejection rule with the draft's real proposal distribution q keeps
the target distribution on a small vocabulary (a statistical bound two wrong rules fail), the dense
distribution it uses is the sampler's own, and drafts of another vocabulary or tokenizer, or the
draft method without a draft model, are refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmax.engine.api import (
    SPEC_KS,
    GenerationRequest,
    InvalidRequest,
    Speculation,
    validate_request,
)
from gemmax.engine.draft import DraftMismatch, probabilities, propose_rows
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model
from gemmax.engine.sampling import SamplingState
from gemmax.engine.steps import init_device_state, verify_rows
from gemmax.model.forward import forward_jit
from gemmax.model.kv_cache import init_cache
from tiny_checkpoint import write_tiny_checkpoint

PLAIN = Speculation("off")


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    """Refused when the engine is built, before anything compiles, with both values."""
    checkpoint = write_tiny_checkpoint(tmp_path / "target")
    target = load_model(str(checkpoint), "float32")
    small = load_model(str(write_tiny_checkpoint(tmp_path / "small", vocab_size=384)), "float32")
    with pytest.raises(DraftMismatch, match="384"):
        BatchEngine(target, max_model_len=64, max_batch=1, buckets=(16,), speculation=PLAIN, draft=small)
    renamed = tmp_path / "renamed"
    shutil.copytree(checkpoint, renamed)
    tokenizer = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two learned tokens swap ids: same size, other text
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftMismatch, match="another tokenizer"):
        BatchEngine(target, max_model_len=64, max_batch=1, buckets=(16,), speculation=PLAIN,
                    draft=load_model(str(renamed), "float32"))
    with pytest.raises(ValueError, match="--speculative draft"):
        BatchEngine(target, max_model_len=64, max_batch=1, buckets=(16,), draft=target)


def test_draft_method_needs_a_draft_model():
    with pytest.raises(InvalidRequest) as refused:
        validate_request(GenerationRequest((1, 2, 3), 4, speculative=Speculation("draft", 4)), max_model_len=64,
                         vocab_size=128, spec_ks=SPEC_KS)
    assert refused.value.param == "speculative.method" and "--draft-model" in str(refused.value)
    validate_request(GenerationRequest((1, 2, 3), 4, speculative=Speculation("draft", 4)), max_model_len=64,
                     vocab_size=128, spec_ks=SPEC_KS, draft=True)


def _total_variation(samples, p):
    return 0.5 * np.abs(np.bincount(samples, minlength=len(p)) / len(samples) - np.asarray(p, np.float64)).sum()


def test_probabilities_are_the_samplers_distribution():
    """`probabilities` (the p and q of the rule) is the distribution `choose_ids` draws from, for
    temperature alone and with top-k, top-p and min-p: 6,000 draws per setting, own keys."""
    from gemmax.engine.sampling import choose_ids

    rows, V = 6000, 96
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 2.0, V), jnp.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), rows))
    for settings in ({}, {"top_k": 10}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.8}):
        state = dataclasses.replace(SamplingState.empty(rows, V), temperature=jnp.full(rows, 0.9), key=keys,
                                    **{name: jnp.full(rows, value) for name, value in settings.items()})
        dense = np.asarray(jax.jit(probabilities)(jnp.broadcast_to(logits, (rows, V)), state)[0], np.float64)
        drawn = np.asarray(jax.jit(choose_ids)(jnp.broadcast_to(logits, (rows, V)), state))
        assert abs(dense.sum() - 1) < 1e-5 and np.all(dense[np.bincount(drawn, minlength=V) > 0] > 0), settings
        assert _total_variation(drawn, dense) < 0.06, settings  # ~0.03 expected from 6,000 draws


def test_draft_rejection_rule_keeps_the_target_distribution(hf_checkpoints, tmp_path):
    """The device path on a small vocabulary (96): a draft (the same config, another random seed)
    proposes k = 2 tokens per row by sampling at temperature 0.1 after the same token, the target
    verifies with q; over 20,000 rows with their own seeds the first output token follows the
    target's p0, a proposal is kept with probability sum(min(p0, q0)), and the token after a kept
    first proposal follows p1 given it. The rule that draws a rejection from p instead of
    norm(max(0, p - q)) gives, computed exactly from p0 and q0, a distribution three bounds away.
    (Keeping x with probability p(x), ignoring q, is almost harmless on distributions this flat:
    p0's largest entry is about 0.09, so no feasible sample tells it apart.)"""
    from hf_reference import build_gemma4

    loaded = load_model(str(hf_checkpoints["g4_plain"][0]), "float32")
    build_gemma4("g4_plain", tmp_path / "draft", seed=7)
    draft = load_model(str(tmp_path / "draft"), "float32")
    config, params, precision = loaded.checkpoint.config, loaded.checkpoint.params, loaded.policy.precision()
    dconfig = draft.checkpoint.config
    rows, first, temperature, k = 20000, 7, 0.1, 2
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), rows))
    sampling = dataclasses.replace(SamplingState.empty(rows, config.vocab_size), temperature=jnp.full(rows, temperature),
                                   key=keys)
    cache, proposals, q = propose_rows(
        draft.checkpoint.params, init_cache(dconfig, rows, 8, precision.kv_cache, max(SPEC_KS)), sampling,
        jnp.arange(rows), jnp.tile(jnp.asarray([[first, 0]], jnp.int32), (rows, 1)), jnp.zeros(rows, jnp.int32),
        jnp.ones(rows, jnp.int32), jnp.zeros((rows, k), jnp.int32), k=k, config=dconfig, precision=precision, kv_len=8)
    device = init_device_state(config, rows, 8, precision, max(SPEC_KS))
    device = dataclasses.replace(device, sampling=sampling, tokens=jnp.full(rows, first, jnp.int32),
                                 remaining=jnp.full(rows, 4, jnp.int32))
    _, (drawn, accepted, *_) = verify_rows(params, device, jnp.zeros(rows, bool), jnp.arange(rows), proposals,
                                           jnp.full(rows, k, jnp.int32), q, jnp.ones(rows, bool), config=config,
                                           precision=precision, kv_len=8)
    drawn, accepted, proposals = np.asarray(drawn), np.asarray(accepted), np.asarray(proposals)

    def target_probs(tokens):
        logits, _ = forward_jit(params, init_device_state(config, 1, 8, precision).cache, jnp.asarray([tokens]),
                                jnp.zeros(1, jnp.int32), jnp.full(1, len(tokens), jnp.int32), config=config,
                                precision=precision)
        return np.asarray(jax.nn.softmax(logits[0] / temperature), np.float64)

    p0, q0 = target_probs([first]), np.asarray(q[0, 0], np.float64)
    assert np.allclose(np.asarray(q[:, 0]), q0, atol=1e-6)  # every row's draft saw the same context
    bound = 0.05  # ~0.028 expected from 20,000 draws over 96 tokens
    assert _total_variation(drawn[:, 0], p0) < bound
    keep = np.minimum(1.0, p0 / np.maximum(q0, 1e-30))
    residual_from_p = q0 * keep + (1 - np.sum(q0 * keep)) * p0
    assert 0.5 * np.abs(residual_from_p - p0).sum() > 3 * bound
    kept = accepted >= 1
    assert np.all(drawn[kept, 0] == proposals[kept, 0])
    rate = np.sum(np.minimum(p0, q0))
    assert abs(kept.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / rows)
    x = np.bincount(drawn[kept, 0]).argmax()  # the most common kept first token
    follow = kept & (drawn[:, 0] == x)
    assert follow.sum() > 400
    expected = 0.8 * np.sqrt(96 / follow.sum())  # about twice the distance that many draws from a flat p show
    assert _total_variation(drawn[follow, 1], target_probs([first, int(x)])) < expected


def test_serve_flags_pair_the_draft_model_with_its_method():
    import typer

    from gemmax.cli import _speculation

    assert _speculation("draft", 8, "small") == Speculation("draft", 8)
    assert _speculation("on-request", 4, "small") == Speculation("off", 4)
    with pytest.raises(typer.BadParameter, match="--draft-model"):
        _speculation("draft", 4, None)
    with pytest.raises(typer.BadParameter, match="--speculative draft"):
        _speculation("ngram", 4, "small")
