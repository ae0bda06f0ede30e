"""Speculative decoding through the batching engine: plain decoding in the same engine is the reference
(greedy token-identical, seeded sampling draw-identical), and the verify step's rejection rule keeps
the target distribution (a statistical bound that always-accept fails)."""

from __future__ import annotations

import numpy as np
import pytest

from gemmax.engine.api import SPEC_KS, GenerationRequest, InvalidRequest, SamplingParams, Speculation
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model
from gemmax.engine.speculative import RequestSpeculation, propose_ngram

PLAIN = Speculation("off")


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    return load_model(str(hf_checkpoints["g4_shared"][0]), "float32")  # sliding window 4, KV sharing


@pytest.fixture(scope="module")
def engine(loaded):
    eng = BatchEngine(loaded, max_model_len=160, max_batch=3, buckets=(16,), steps_per_dispatch=3,
                      speculation=PLAIN).start()
    assert eng.wait_ready(600)
    yield eng
    eng.shutdown(drain_timeout=5)


def _run(engine, prompt, max_tokens, spec, **extra):
    return engine.submit(GenerationRequest(tuple(prompt), max_tokens, speculative=spec, ignore_eos=True, **extra))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(5, 40, n):
        motif = rng.integers(3, 128, rng.integers(2, 6))  # repeats: prompt lookup finds matches
        out.append(tuple(int(t) for t in np.resize(np.concatenate([motif, rng.integers(3, 128, 3)]), length)))
    return out


def test_ngram_proposer_takes_the_latest_longest_match():
    ctx = np.asarray([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert list(propose_ngram(ctx, 4)) == [7, 8, 5, 2]  # "2 3" last seen before 7 8 (n=3 "5 2 3" absent)
    assert list(propose_ngram(np.asarray([4, 5, 6, 4, 5]), 8)) == [6, 4, 5]  # cut at the context's end
    assert list(propose_ngram(np.asarray([1, 2, 3]), 4)) == []
    assert list(propose_ngram(np.asarray([1, 2, 1, 3, 1]), 2)) == [3, 1]  # n=1: latest earlier 1


def test_greedy_speculative_equals_plain_for_every_k_in_a_mixed_batch(engine):
    """Requests with k = 2, 4, 8 and plain ones, different lengths, more than the slots, all at once:
    each speculative request gets exactly the tokens the same request gets decoded plainly, and the
    long ones cross the window-4 ring many times with both accepted and rejected proposals."""
    prompts = _prompts(6)
    budgets = [90, 40, 120, 17, 60, 30]
    specs = [Speculation("ngram", k) for k in SPEC_KS] * 2
    plain = [_run(engine, p, b, PLAIN) for p, b in zip(prompts, budgets, strict=True)]
    spec = [_run(engine, p, b, s) for p, b, s in zip(prompts, budgets, specs, strict=True)]
    mixed = [_run(engine, p, b, PLAIN if i % 2 else s)
             for i, (p, b, s) in enumerate(zip(prompts, budgets, specs, strict=True))]
    rejected = 0
    for i, (a, b, c) in enumerate(zip(plain, spec, mixed, strict=True)):
        reference = a.wait().token_ids
        result = b.wait()
        assert result.token_ids == reference, f"request {i} (k={specs[i].k})"
        assert c.wait().token_ids == reference, f"request {i} in the mixed batch"
        assert result.finish_reason == "length" and len(reference) == budgets[i]
        stats = result.speculation
        assert stats.steps == sum(stats.accepted_lengths) and stats.accepted <= stats.proposed
        assert len(stats.accepted_lengths) <= specs[i].k + 1
        rejected += stats.proposed - stats.accepted
        assert a.result.speculation is None
    assert rejected > 0
    assert sum(r.result.speculation.accepted for r in spec) > 0
