"""The JAX model against transformers 5.23.0 on small random checkpoints (float32).

Checkpoints come from tests/hf_reference.py (every Gemma 4 feature switched on by at least one
config, norms and layer_scalar randomised) and are loaded by gemmax's real loader.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gemmax.engine.generate import generate
from gemmax.model.forward import forward_jit as forward
from gemmax.model.kv_cache import init_cache
from gemmax.weights.load import load_checkpoint

CONFIGS = ["g4_shared", "g4_k_eq_v", "g4_plain", "g3_small"]
TOL = 1e-4


def _load(hf_checkpoints, name):
    directory, model = hf_checkpoints[name]
    return load_checkpoint(directory, weight_dtype=jnp.float32), model


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _full_forward(ck, ids: np.ndarray, max_len: int = 96) -> np.ndarray:
    B, T = ids.shape
    cache = init_cache(ck.config, B, max_len)
    logits, _ = forward(ck.params, cache, jnp.asarray(ids, jnp.int32), jnp.zeros(B, jnp.int32),
                        jnp.full(B, T, jnp.int32), config=ck.config, logits="all")
    return np.asarray(logits)


@pytest.mark.parametrize("name", CONFIGS)
def test_full_prompt_logits_match_transformers(hf_checkpoints, name):
    ck, model = _load(hf_checkpoints, name)
    window = ck.config.sliding_window
    ids = np.random.default_rng(1).integers(0, ck.config.vocab_size, (2, 3 * window + 2))  # longer than the window
    diff = np.abs(_full_forward(ck, ids) - _hf_logits(model, ids)).max()
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e} > {TOL}"


@pytest.mark.parametrize("name", ["g4_shared", "g3_small"])
def test_long_chunks_attend_in_query_blocks_as_transformers(hf_checkpoints, name):
    """Chunks longer than QUERY_BLOCK take the blocked path (each query block reads only the chunk
    keys it can see, from its window's start to its end, beside the cached keys): a first chunk with
    nothing cached and a second after it, one row ending in padding inside the second chunk, KV
    sharing on g4_shared. Logits at every real position
    equal transformers' on each prompt alone."""
    from gemmax.model.forward import QUERY_BLOCK

    ck, model = _load(hf_checkpoints, name)
    chunk = 2 * QUERY_BLOCK
    lengths = [2 * chunk, chunk + 44]
    ids = np.random.default_rng(7).integers(3, ck.config.vocab_size, (2, 2 * chunk))
    cache = init_cache(ck.config, 2, 2 * chunk)
    got = []
    for c in range(2):
        num_new = np.clip(np.asarray(lengths) - c * chunk, 0, chunk)
        logits, cache = forward(ck.params, cache, jnp.asarray(ids[:, c * chunk : (c + 1) * chunk], jnp.int32),
                                jnp.full(2, c * chunk, jnp.int32), jnp.asarray(num_new, jnp.int32),
                                config=ck.config, logits="all")
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    for row, n in enumerate(lengths):
        diff = np.abs(got[row, :n] - _hf_logits(model, ids[row : row + 1, :n])[0]).max()
        assert diff <= TOL, f"{name} row {row}: max |logit diff| {diff:.2e} > {TOL}"


@pytest.mark.parametrize("name", CONFIGS)
def test_incremental_decode_matches_full_forward(hf_checkpoints, name):
    """Prefill 5 tokens, then 40 single-token steps (crossing the ring several times) vs one full pass."""
    ck, model = _load(hf_checkpoints, name)
    ids = np.random.default_rng(2).integers(0, ck.config.vocab_size, (1, 45))
    reference = _hf_logits(model, ids)[0]
    cache = init_cache(ck.config, 1, 64)
    logits, cache = forward(ck.params, cache, jnp.asarray(ids[:, :5], jnp.int32), jnp.array([0]), jnp.array([5]),
                            config=ck.config)
    got = [np.asarray(logits)[0]]
    for t in range(5, 45):
        logits, cache = forward(ck.params, cache, jnp.asarray(ids[:, t : t + 1], jnp.int32), jnp.array([t]),
                                jnp.array([1]), config=ck.config)
        got.append(np.asarray(logits)[0])
    diff = np.abs(np.stack(got) - reference[4:]).max()
    assert diff <= TOL, f"{name}: decode vs full forward {diff:.2e}"


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_64_tokens_equal_transformers_generate(hf_checkpoints, name):
    ck, model = _load(hf_checkpoints, name)
    prompt = [2, 17, 33, 5, 61, 8, 40]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    got = generate(ck.params, ck.config, prompt, 64, stop_ids=())
    assert got == expected


@pytest.mark.parametrize("name", CONFIGS)
def test_padded_batch_rows_equal_each_prompt_alone(hf_checkpoints, name):
    """Prompts of different lengths padded to one bucket give each row's own logits and greedy tokens,
    including rows whose padding is longer than the sliding window (the "The The The" bug)."""
    ck, _ = _load(hf_checkpoints, name)
    window = ck.config.sliding_window
    bucket = 4 * window + 3
    rng = np.random.default_rng(3)
    lengths = [1, 2, window + 1, bucket]  # the first rows carry > window of padding
    prompts = [rng.integers(3, ck.config.vocab_size, n).tolist() for n in lengths]
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    # The cache of test_incremental_decode_matches_full_forward (room for the bucket and 11 steps): the
    # solo decode, and the 1-token and (window 4) 5-token solo prefills, reuse its compiled programs.
    max_len = 64
    assert bucket + 12 <= max_len
    cache = init_cache(ck.config, len(prompts), max_len)
    logits, cache = forward(ck.params, cache, jnp.asarray(tokens), jnp.zeros(len(prompts), jnp.int32),
                            jnp.asarray(lengths, jnp.int32), config=ck.config)
    batched_tokens = [[int(t)] for t in np.argmax(np.asarray(logits), -1)]
    start = jnp.asarray(lengths, jnp.int32)
    for _ in range(11):  # batched greedy decode, every row at its own position
        step_ids = jnp.asarray([[row[-1]] for row in batched_tokens], jnp.int32)
        step_logits, cache = forward(ck.params, cache, step_ids, start, jnp.ones(len(prompts), jnp.int32),
                                     config=ck.config)
        for row, t in enumerate(np.argmax(np.asarray(step_logits), -1)):
            batched_tokens[row].append(int(t))
        start = start + 1
    for row, prompt in enumerate(prompts):
        # Alone = the same compiled shape [4, bucket] with every other row replaced by unrelated tokens
        # (so only padding or cross-row leakage could change this row) ...
        alone_tokens = np.asarray(rng.integers(3, ck.config.vocab_size, tokens.shape), np.int32)
        alone_tokens[row] = tokens[row]
        alone_lengths = np.full(len(prompts), bucket, np.int32)
        alone_lengths[row] = len(prompt)
        alone, _ = forward(ck.params, init_cache(ck.config, len(prompts), max_len), jnp.asarray(alone_tokens),
                           jnp.zeros(len(prompts), jnp.int32), jnp.asarray(alone_lengths), config=ck.config)
        diff = np.abs(np.asarray(alone)[row] - np.asarray(logits)[row]).max()
        assert diff <= 1e-5, f"row {row} (len {len(prompt)}): padded-batch logits differ by {diff:.2e}"
        # ... and unpadded, exact length: equal within float reassociation, same greedy tokens.
        exact, exact_cache = forward(ck.params, init_cache(ck.config, 1, max_len), jnp.asarray([prompt], jnp.int32),
                                     jnp.array([0]), jnp.array([len(prompt)]), config=ck.config)
        assert np.abs(np.asarray(exact)[0] - np.asarray(logits)[row]).max() <= TOL
        # ... and decoded alone from there, the batch's greedy tokens (one decode shape for every row)
        solo = [int(np.argmax(np.asarray(exact)[0]))]
        for t in range(11):
            step_logits, exact_cache = forward(ck.params, exact_cache, jnp.asarray([[solo[-1]]], jnp.int32),
                                               jnp.array([len(prompt) + t]), jnp.array([1]), config=ck.config)
            solo.append(int(np.argmax(np.asarray(step_logits)[0])))
        assert solo == batched_tokens[row]


def test_kv_len_bound_reads_only_what_the_context_uses(hf_checkpoints):
    """Decode reading only the first kv_len full-attention slots (the engine's KV-length buckets) gives
    the logits of reading all max_len slots, across the ring's wrap-around."""
    ck, _ = _load(hf_checkpoints, "g4_shared")
    ids = np.random.default_rng(4).integers(0, ck.config.vocab_size, (2, 30))
    outputs = {}
    for kv_len in (None, 32):
        cache = init_cache(ck.config, 2, 256)
        logits, cache = forward(ck.params, cache, jnp.asarray(ids[:, :6], jnp.int32), jnp.zeros(2, jnp.int32),
                                jnp.full(2, 6, jnp.int32), config=ck.config, kv_len=kv_len)
        steps = [np.asarray(logits)]
        for t in range(6, 30):
            logits, cache = forward(ck.params, cache, jnp.asarray(ids[:, t : t + 1], jnp.int32), jnp.full(2, t, jnp.int32),
                                    jnp.ones(2, jnp.int32), config=ck.config, kv_len=kv_len)
            steps.append(np.asarray(logits))
        outputs[kv_len] = np.stack(steps)
    assert np.abs(outputs[None] - outputs[32]).max() <= 1e-5


def test_tightest_kv_len_also_bounds_sliding_rings_before_they_wrap(hf_checkpoints):
    """kv_len = cached tokens + 1 at every step (tighter than any engine bucket): while kv_len is below
    a sliding layer's ring the ring is read only up to kv_len too; the logits equal reading every slot,
    before, at and after the ring wraps round (window 4, 9 tokens)."""
    ck, _ = _load(hf_checkpoints, "g4_shared")
    assert ck.config.sliding_window == 4
    ids = np.random.default_rng(5).integers(0, ck.config.vocab_size, (2, 9))
    outputs = {}
    for bound in (False, True):
        cache = init_cache(ck.config, 2, 64)
        steps = []
        for t in range(9):
            logits, cache = forward(ck.params, cache, jnp.asarray(ids[:, t : t + 1], jnp.int32), jnp.full(2, t, jnp.int32),
                                    jnp.ones(2, jnp.int32), config=ck.config, kv_len=t + 1 if bound else None)
            steps.append(np.asarray(logits))
        outputs[bound] = np.stack(steps)
    assert np.abs(outputs[False] - outputs[True]).max() <= 1e-5


@pytest.mark.parametrize("kv_cache", ["bfloat16", "int8"])
def test_a_chunk_attends_its_own_keys_as_the_cache_holds_them(hf_checkpoints, kv_cache):
    """With a 16-bit or int8 cache a decode step's query reads its own token's K/V back from the cache
    (rounded); a chunk's queries see their own K/V rounded alike, so the first position of a chunk (a
    speculative verify step, a prompt's next chunk) gives the logits a decode step gives at that
    position (to float summation order), crossing the sliding rings (window 4) several times.
    Unrounded, they differed by 4e-2 (bf16) and 8e-2 (int8) here, and on a bf16 copy of this config a
    greedy speculative step drew another token than plain decoding (logit 0.46 -> 0.22)."""
    ck, _ = _load(hf_checkpoints, "g4_shared")
    ids = np.random.default_rng(5).integers(3, ck.config.vocab_size, 40)
    cache = init_cache(ck.config, 1, 64, kv_cache)
    _, cache = forward(ck.params, cache, jnp.asarray(ids[None, :8], jnp.int32), jnp.array([0]), jnp.array([8]),
                       config=ck.config)
    worst = 0.0
    for t in range(8, 39):
        step = dict(config=ck.config, logits="all")
        decoded, _ = forward(ck.params, cache, jnp.asarray(ids[None, t:t + 1], jnp.int32), jnp.array([t]),
                             jnp.array([1]), **step)
        chunk, _ = forward(ck.params, cache, jnp.asarray(ids[None, t:t + 2], jnp.int32), jnp.array([t]),
                           jnp.array([2]), **step)
        worst = max(worst, float(np.abs(np.asarray(decoded)[0, 0] - np.asarray(chunk)[0, 0]).max()))
        _, cache = forward(ck.params, cache, jnp.asarray(ids[None, t:t + 1], jnp.int32), jnp.array([t]),
                           jnp.array([1]), config=ck.config)
    assert worst <= 1e-4, f"{kv_cache}: a chunk's first position differs from the decode step by {worst:.2e}"
