"""The sampler's packed token mask on its own (small vocabulary, no model): masked rows draw only
allowed tokens (greedy: the best allowed one), all-ones rows draw exactly what they draw without a
mask, greedy or sampled, filtered or not; the packing matches llguidance's own bitmask layout."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import llguidance
import llguidance.numpy
import numpy as np
import pytest

from gemmax.engine.api import Constraint, GenerationRequest, SamplingParams
from gemmax.engine.sampling import SamplingState, sample, unpack_mask

B, V = 6, 1000  # V not a multiple of 32: the last word is partial


def _state():
    state = SamplingState.empty(B, V)
    return dataclasses.replace(
        state, temperature=jnp.asarray([0.0, 0.7, 1.0, 0.0, 1.3, 0.9], jnp.float32),
        top_k=jnp.asarray([0, 0, 40, 0, 0, 0], jnp.int32), top_p=jnp.asarray([1, 1, 1, 1, 0.9, 1], jnp.float32),
        min_p=jnp.asarray([0, 0, 0, 0, 0, 0.05], jnp.float32),
        key=jnp.asarray(np.random.default_rng(0).integers(0, 2**31, (B, 2)), jnp.uint32))


def _pack(allowed: np.ndarray) -> np.ndarray:
    """[B, V] bool -> [B, ceil(V / 32)] int32, bit j of word i = token 32 i + j."""
    padded = np.zeros((allowed.shape[0], -(-V // 32) * 32), np.uint32)
    padded[:, :V] = allowed
    words = (padded.reshape(allowed.shape[0], -1, 32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    return words.view(np.int32)


def test_mask_unpacks_in_llguidance_layout(tmp_path):
    rng = np.random.default_rng(1)
    allowed = rng.random((B, V)) < 0.3
    assert np.array_equal(np.asarray(unpack_mask(jnp.asarray(_pack(allowed)), V)), allowed)
    # llguidance's own packing: the tokens our unpacking reads as allowed are exactly those the
    # matcher accepts one by one (a real tokenizer, a regex whose first character is A or B).
    from gemmax.weights.tokenizer import load_tokenizer
    from tiny_checkpoint import write_tokenizer

    tokenizer = load_tokenizer(write_tokenizer(tmp_path))
    n = tokenizer.vocab_size
    tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n, eos_token=[1])
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_regex("[AB]x[0-9]*"))
    mask = llguidance.numpy.allocate_token_bitmask(1, n)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    ours = np.asarray(unpack_mask(jnp.asarray(mask), n))[0]
    accepted = np.asarray([matcher.validate_tokens([t]) == 1 for t in range(n)])
    assert ours.any() and np.array_equal(ours, accepted)


def test_compiler_masks_equal_llguidance_defaults(tmp_path):
    """The compiler's slices (`constraints.SLICES`) and its one-call fill of several rows are only a
    faster way to the same masks: along sampled walks through short bounded strings, every row of every
    step equals llguidance's own row-by-row mask under its default slices and under none."""
    from gemmax.engine.constraints import ConstraintCompiler, grammar_of
    from gemmax.weights.tokenizer import load_tokenizer
    from tiny_checkpoint import EOS_ID, write_tokenizer

    tokenizer = load_tokenizer(write_tokenizer(tmp_path))
    n = tokenizer.vocab_size
    compiler = ConstraintCompiler(tokenizer.backend.to_str(), n, (EOS_ID,))
    references = [llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n, eos_token=[EOS_ID], slices=s)
                  for s in (None, [])]
    schema = {"type": "array", "minItems": 12, "items": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "minLength": 1, "maxLength": 3}, "b": {"type": "string", "maxLength": 8}}}}
    constraint = Constraint("json_schema", json.dumps(schema))
    rows = [compiler.matcher(constraint) for _ in range(4)]
    others = [[llguidance.LLMatcher(t, grammar_of(constraint)) for _ in rows] for t in references]
    rng = np.random.default_rng(4)
    for _ in range(60):
        masks = compiler.masks(len(rows))
        compiler.fill_rows([(m, j) for j, m in enumerate(rows)], masks)
        for matchers in others:
            expected = llguidance.numpy.allocate_token_bitmask(len(rows), n)
            for j, m in enumerate(matchers):
                llguidance.numpy.fill_next_token_bitmask(m, expected, j)
            assert np.array_equal(masks, expected)
        allowed = np.asarray(unpack_mask(jnp.asarray(masks), n))
        for j, m in enumerate(rows):
            choices = np.flatnonzero(allowed[j] & (np.arange(n) != EOS_ID))
            token = int(rng.choice(choices))
            assert m.consume_token(token) and all(o[j].consume_token(token) for o in others)


def test_masked_rows_draw_allowed_tokens_and_free_rows_are_unchanged():
    state = _state()
    want = jnp.zeros(B, jnp.bool_)
    ones = np.ones((B, V), np.bool_)
    rng = np.random.default_rng(2)
    run = jax.jit(lambda lg, st, m: sample(lg, st, want, None, m)[0])
    free = jax.jit(lambda lg, st: sample(lg, st, want)[0])
    for step in range(20):
        logits = jnp.asarray(rng.normal(size=(B, V)) * 3, jnp.float32)
        st = dataclasses.replace(state, step=jnp.full(B, step, jnp.int32))
        allowed = ones.copy()
        allowed[1::2] = rng.random((B // 2, V)) < 0.05  # odd rows constrained, even rows free
        ids = np.asarray(run(logits, st, jnp.asarray(_pack(allowed))))
        unmasked = np.asarray(free(logits, st))
        assert all(allowed[b, ids[b]] for b in range(B))
        assert np.array_equal(ids[0::2], unmasked[0::2])  # free rows: the very same draws
        best_allowed = np.argmax(np.where(allowed[3], np.asarray(logits[3]), -np.inf))
        assert ids[3] == best_allowed  # greedy row 3 (constrained): the best allowed token


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    from gemmax.engine.loading import load_model
    from tiny_checkpoint import write_tiny_checkpoint

    return load_model(str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")), "float32")


@pytest.fixture(scope="module")
def tiny_engine(tiny_loaded):
    from gemmax.engine.engine import BatchEngine

    eng = BatchEngine(tiny_loaded, max_model_len=64, max_batch=4, buckets=(16,), steps_per_dispatch=2, warm_up=False)
    eng.shapes = dataclasses.replace(eng.shapes, decode_groups=(4,))  # one decode shape: free and masked
    eng.start()
    assert eng.wait_ready(300)
    yield eng, tiny_loaded.tokenizer
    eng.shutdown(drain_timeout=5)


def test_free_rows_beside_constrained_rows_in_the_engine(tiny_engine):
    """Through the batching engine on a tiny random checkpoint: free rows (greedy and seeded) in a
    batch with constrained rows give exactly the tokens they give alone (the mask-free step), and the
    constrained rows hold their regex. Slots alternate constrained / free, so a mask filled into the
    wrong row both changes a free row's tokens and lets a constrained row draw a refused token."""
    eng, tok = tiny_engine
    prompt = tuple(tok.encode("Hello world"))
    pattern = "[ab]+"
    free = [GenerationRequest(prompt, 12, SamplingParams()),
            GenerationRequest(prompt, 12, SamplingParams(temperature=1.0, seed=7))]
    constrained = [GenerationRequest(prompt, 10, SamplingParams(temperature=t, seed=3), constraint=Constraint("regex", pattern))
                   for t in (0.0, 1.0)]
    alone = [eng.submit(r).wait() for r in free]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in alone)
    mixed = [eng.submit(r) for r in (constrained[0], free[0], constrained[1], free[1])]  # slots 0..3
    results = [h.wait() for h in mixed]
    for result in (results[0], results[2]):
        assert result.finish_reason in ("stop", "length"), result
        assert re.fullmatch("[ab]*", tok.decode(result.token_ids)) and result.token_ids, tok.decode(result.token_ids)
    assert [results[1].token_ids, results[3].token_ids] == [r.token_ids for r in alone]


def test_a_constrained_request_is_flagged_exactly_when_its_draw_compiles(tiny_loaded):
    """`uncompiled_shape` says a request waited for a compile. Constrained draws are not warmed up: a
    constrained prompt's first token compiles the masked one-row draw; a decode group of one row
    draws with that same program, so a later request that decodes alone compiles nothing and is not
    flagged (it was, when the flag was set on a group size's first constrained decode); a group of
    two compiles its own masked draw, and both its rows are flagged."""
    from gemmax.engine.engine import BatchEngine

    eng = BatchEngine(tiny_loaded, max_model_len=64, max_batch=2, buckets=(16,), steps_per_dispatch=2,
                      prefix_cache_bytes=0).start()
    try:
        assert eng.wait_ready(300)
        prompt = tuple(tiny_loaded.tokenizer.encode("Hello world"))

        def run(max_tokens: int, n: int = 1) -> tuple[list[bool], int]:
            """(each request's flag, masked draw programs compiled meanwhile) for n requests at once (24
            letters: more than 12 tokens of this tokenizer, so each one decodes to max_tokens)."""
            before = eng.steps.draw.size()
            handles = [eng.submit(GenerationRequest(prompt, max_tokens, SamplingParams(temperature=1.0, seed=seed),
                                                    constraint=Constraint("regex", "[ab]{24}")))
                       for seed in range(n)]
            results = [h.wait() for h in handles]
            assert all(len(r.token_ids) == max_tokens for r in results)
            return [r.timings.uncompiled_shape for r in results], eng.steps.draw.size() - before

        assert run(1) == ([True], 1)  # the first token only: the masked one-row draw compiles
        assert run(6) == ([False], 0)  # then it decodes as a group of one: the same program
        # a group of two: its own masked draw (12 tokens: the first still decoding when the second is
        # admitted, even if it was admitted alone)
        assert run(12, n=2) == ([True, True], 1)
    finally:
        eng.shutdown(drain_timeout=5)
