"""The sampler's pieces that the engine tests reach only through whole generations: the greedy argmax
(first index of the maximum, as jnp.argmax) and which rows' state a step advances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmax.engine.sampling import SamplingState, _argmax, sample


@pytest.mark.parametrize("vocab", [262144, 4096, 1000])  # 1000: not a multiple of the block
def test_argmax_is_the_first_index_of_the_maximum(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    logits[1, [7, 600, vocab - 1]] = 9.0  # ties in different blocks: the first wins
    logits[2, [vocab - 2, vocab - 1]] = 9.0  # ties in the last block
    logits[3, vocab - 1] = 9.0  # the very last entry
    logits[4, :] = 1.5  # all equal
    logits[5, :] = -np.inf  # nothing finite
    logits[6, [513, 512]] = 9.0  # a tie across a block boundary
    got = np.asarray(jax.jit(_argmax)(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert list(got[1:7]) == [7, vocab - 2, vocab - 1, 0, 0, 512]


def test_only_advancing_rows_count_their_token():
    vocab = 64
    state = SamplingState.empty(3, vocab)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, vocab)), jnp.float32)
    ids, _, _, _, new = sample(logits, state, jnp.zeros(3, jnp.bool_), jnp.asarray([True, False, True]))
    np.testing.assert_array_equal(np.asarray(ids), np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(new.step), [1, 0, 1])
    counts = np.asarray(new.output_counts)
    assert counts[0, int(ids[0])] == 1 and counts[2, int(ids[2])] == 1
    assert counts.sum() == 2 and counts[1].sum() == 0
    _, _, _, _, every = sample(logits, state, jnp.zeros(3, jnp.bool_))  # default: every row advances
    np.testing.assert_array_equal(np.asarray(every.step), [1, 1, 1])
