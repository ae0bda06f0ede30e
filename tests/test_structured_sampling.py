"""The sampler's packed token mask on its own (small vocabulary, no model): masked rows draw only
allowed tokens (greedy: the best allowed one), all-ones rows draw exactly what they draw without a
mask, greedy or sampled, filtered or not; the packing matches llguidance's own bitmask layout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import llguidance
import llguidance.numpy
import numpy as np

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
